"""Glue for training frameworks, one module each, imported only by the users of that
framework (``snaploader.integrations.lightning``, ...): importing snaploader never
imports a framework."""
