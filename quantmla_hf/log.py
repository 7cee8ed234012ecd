"""The package's loggers: standard `logging` loggers named after their module ("quantmla_hf.integration") whose
records also follow transformers' verbosity, as transformers' own messages do.

`transformers.logging.set_verbosity_error()` (or `TRANSFORMERS_VERBOSITY=error`) silences the library's warnings.
Everything else is the standard library's, as for any library logger: the loggers' levels (unset, so WARNING unless
the application sets one) and where a record goes (stderr by default, or the application's handlers).
"""

from __future__ import annotations

import logging

from transformers.utils import logging as transformers_logging


class _TransformersVerbosity(logging.Filter):
    """Passes a record at or above transformers' verbosity (`transformers.logging.get_verbosity()`, read per record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= transformers_logging.get_verbosity()


_FOLLOW_TRANSFORMERS = _TransformersVerbosity()


def get_logger(name: str) -> logging.Logger:
    """The logger `name` (a module's `__name__`), its records kept to transformers' verbosity.

    The filter compares each record with the verbosity when the record is made, so a `set_verbosity_*` call applies
    to loggers created before it.
    """
    logger = logging.getLogger(name)
    if _FOLLOW_TRANSFORMERS not in logger.filters:
        logger.addFilter(_FOLLOW_TRANSFORMERS)
    return logger
