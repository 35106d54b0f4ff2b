"""What the model store's client raises: the store away (a host may go on with
what it kept), a refusal, a model it does not hold, a version pushed again."""

from __future__ import annotations

from services.errors import ModelError


class ModelStoreError(ModelError):
    """The model store is not configured, cannot be reached, or refused a request."""


class ModelStoreUnavailable(ModelStoreError):
    """The store could not be reached, or failed to answer (not a refusal): a host
    may go on with the copy of a manifest it kept."""


class ModelNotInStore(ModelStoreError):
    """No such model, or no such version of it, in the store."""


class ModelVersionExists(ModelStoreError):
    """A push of a version the store holds with other content, not forced."""
