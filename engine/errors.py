"""Engine errors. Bad input is a ValueError subclass whose message names the
problem, so services can map it to INVALID_ARGUMENT / HTTP 400 in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose (CLIs print these plainly)."""


class EngineInputError(EngineError, ValueError):
    """A request the engine cannot run as given (empty prompt, token out of
    vocabulary, prompt longer than the context, restored KV of the wrong shape)."""


class ModelLoadError(EngineError, RuntimeError):
    """A model directory or file is missing, corrupted or of an unsupported kind."""


class ModelConfigError(EngineError, ValueError):
    """A model or engine configuration value is invalid; the message names the field."""


class PoolExhaustedError(EngineError, RuntimeError):
    """The paged KV pool has no free block left (all are held by live sequences)."""


class DeviceError(EngineError, RuntimeError):
    """The requested device cannot run this configuration (e.g. a GPU-only shape on CPU)."""


class PrefillStopped(EngineError):
    """A prefill was stopped between chunks because its caller went away; the
    sequence is freed and nothing of it stays live."""
