"""The job configuration's schema: sections as dataclasses, field types, ranges and documentation.

The string under each field is its documentation (``--help`` shows it). :func:`validate_config`
checks every value and every rule between values that needs nothing but the config itself;
checks that need the filesystem (datasets, tokenizer, checkpoints, folders) run once in
:func:`torchtitan_lite.job.preflight`, and those that need the world size or the model family in
:func:`torchtitan_lite.job.plan_job`. Nothing here changes a config.

The schema is three modules (:mod:`.sections`, :mod:`.types`, :mod:`.validate`), each importing
nothing of the package but :mod:`torchtitan_lite.errors` and each other; this module is their one
name for the rest of the package.
"""

from torchtitan_lite.config.sections import *  # noqa: F403
from torchtitan_lite.config.sections import __all__ as _sections
from torchtitan_lite.config.types import *  # noqa: F403
from torchtitan_lite.config.types import __all__ as _types
from torchtitan_lite.config.validate import *  # noqa: F403
from torchtitan_lite.config.validate import __all__ as _validate

__all__ = [*_sections, *_types, *_validate]
