"""The error type of user mistakes in settings, shared by every module that checks them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake made by the user: the message names the setting and the fix."""
