"""Exceptions a user can act on. Each message says what was wrong, where, and what to do."""


class FlashxError(Exception):
    """Base class for every error flashx-batch raises on purpose."""


class ModelLoadError(FlashxError):
    """A model directory is missing a file, has an unknown architecture, or a tensor of the wrong shape."""


class ConfigError(FlashxError):
    """A setting is invalid (an unknown key, a value out of range, an unavailable backend)."""


class PromptTooLongError(FlashxError):
    """A prompt exceeds `max_input_len` under `long_input=error`."""

    def __init__(self, index: int, num_tokens: int, max_input_len: int) -> None:
        super().__init__(
            f"prompt {index} has {num_tokens} tokens, more than max_input_len={max_input_len}; "
            "raise max_input_len, or set long_input=truncate to keep the tail."
        )
        self.index = index
        self.num_tokens = num_tokens
        self.max_input_len = max_input_len
