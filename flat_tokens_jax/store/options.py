"""How to reach a store (``StoreOptions``) and what a failure to reach it says (``StoreError``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from flat_tokens_jax.core.urls import redact, redact_text
from flat_tokens_jax.core.values import integer

# The aws_credentials types that StoreOptions.credentials may name alone.
CREDENTIAL_TYPES = ("default", "anonymous", "environment", "imds", "ecs")

# HTTP requests in flight per dataset when StoreOptions.concurrency is None: well
# above what read-ahead asks for (so the rows in flight decide), and below what
# one client should open at once to one endpoint.
CONCURRENCY_CEILING = 1024

# The most attempts per request StoreOptions.retries takes: at the default
# delays, 100 attempts already wait about 51 minutes before a read fails.
MAX_RETRIES = 100


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """How to reach a store (docs/guide/remote.md). Each field applies only to the
    schemes it names.

    Attributes:
        endpoint: ``s3://``: URL of an S3-compatible endpoint (tensorstore does not
            read ``AWS_ENDPOINT_URL``); ``None``: AWS.
        region: ``s3://``: the bucket's region; ``None``: tensorstore asks the bucket.
        credentials: ``s3://``: a tensorstore ``aws_credentials`` spec, a type name
            (:data:`CREDENTIAL_TYPES`) or a mapping such as ``{"type": "profile",
            "profile": "p"}``; ``None``: tensorstore's chain. ``gs://`` credentials
            come from the environment.
        concurrency: ``gs://``/``s3://``: the most HTTP requests in flight; ``None``:
            as many as the reads in flight ask for, up to :data:`CONCURRENCY_CEILING`.
        retries: ``gs://``/``s3://``: attempts per request before a read fails, 1 to
            :data:`MAX_RETRIES`; the default (20) outlasts a throttled bucket's refusals.
        retry_delay: seconds before the first retry; doubling after each.
        max_retry_delay: the longest wait between two attempts, in seconds.
        timeout: seconds any one wait for data may take, retries included, before
            :class:`StoreError`; ``None``: no limit.
        cache_bytes: memory for cached shard indexes and chunks, per dataset.
        context: a ``tensorstore.Context`` shared between datasets, replacing
            ``concurrency``, ``retries``, the delays and ``cache_bytes``
            (:func:`context_spec`); ``None``: one per dataset.
    """

    endpoint: str | None = None
    region: str | None = None
    credentials: str | Mapping[str, Any] | None = None
    concurrency: int | None = None
    retries: int = 20
    retry_delay: float = 1.0
    max_retry_delay: float = 32.0
    timeout: float | None = 600.0
    cache_bytes: int = 256 << 20
    context: ts.Context | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(
                f"StoreOptions.concurrency must be at least 1, or None to follow the reads in "
                f"flight (up to {CONCURRENCY_CEILING}), got {self.concurrency}"
            )
        retries = integer(self.retries, "StoreOptions.retries", low=1, high=MAX_RETRIES)
        object.__setattr__(self, "retries", retries)  # numpy ints become Python ints
        if not 0 < self.retry_delay <= self.max_retry_delay:
            raise ValueError(
                f"StoreOptions.retry_delay ({self.retry_delay}) must be above 0 and at most "
                f"StoreOptions.max_retry_delay ({self.max_retry_delay})"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"StoreOptions.timeout must be positive or None, got {self.timeout}")
        if self.cache_bytes < 0:
            raise ValueError(f"StoreOptions.cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                "StoreOptions.endpoint must be an http:// or https:// URL, got "
                f"{redact(self.endpoint)!r}"
            )
        if isinstance(self.credentials, str) and self.credentials not in CREDENTIAL_TYPES:
            # Not repeated: a secret key passed here by mistake would be echoed.
            raise ValueError(
                "StoreOptions.credentials is a string but not a credentials type (the "
                "value is not repeated here, in case it is a secret): use 'default', "
                "'anonymous', 'environment', 'imds', 'ecs' or a profile mapping"
            )

    def __repr__(self) -> str:
        """The fields, with the endpoint redacted and of the credentials only
        the type and which keys are set, never their values."""
        shown = {f.name: repr(getattr(self, f.name)) for f in dataclasses.fields(self)}
        creds = self.credentials
        if isinstance(creds, Mapping):
            keys = sorted(creds, key=str)
            hidden = [f"{k!r}: {creds[k]!r}" if k == "type" else f"{k!r}: <set>" for k in keys]
            shown["credentials"] = "{" + ", ".join(hidden) + "}"
        if self.endpoint is not None:
            shown["endpoint"] = repr(redact(self.endpoint))
        return "StoreOptions(" + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")"


def resolve_options(
    options: StoreOptions | None, option_fields: Mapping[str, Any], caller: str
) -> StoreOptions:
    """The :class:`StoreOptions` of a function that takes ``options=`` or the
    same fields as keywords (``**option_fields``), but not both (``ValueError``);
    ``TypeError`` for an unknown keyword or ``options`` of another type."""
    if options is not None and not isinstance(options, StoreOptions):
        raise TypeError(f"{caller}: options must be a StoreOptions, got {type(options).__name__}")
    known = [f.name for f in dataclasses.fields(StoreOptions)]
    unknown = sorted(set(option_fields) - set(known))
    if unknown:
        raise TypeError(
            f"{caller} got unexpected keyword arguments {unknown}: besides its own, it "
            f"takes the fields of StoreOptions: {', '.join(known)}"
        )
    if options is not None and option_fields:
        raise ValueError(
            f"{caller}: pass either options=StoreOptions(...) or its fields as keywords "
            f"({', '.join(sorted(option_fields))}), not both"
        )
    return options if options is not None else StoreOptions(**option_fields)


class StoreError(OSError):
    """Reading or writing a store failed: the server is unreachable or keeps
    failing, access is denied, an object is missing, or a read timed out. The
    message names the URL and what to check."""


def _millis(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def context_spec(options: StoreOptions) -> dict[str, Any]:
    """The tensorstore context spec of ``options``: request concurrency and
    retries for GCS and S3, and the cache pool."""
    limit = CONCURRENCY_CEILING if options.concurrency is None else options.concurrency
    retries = {
        # tensorstore's max_retries counts the attempts after the first.
        "max_retries": options.retries - 1,
        "initial_delay": _millis(options.retry_delay),
        "max_delay": _millis(options.max_retry_delay),
    }
    return {
        "gcs_request_concurrency": {"limit": limit},
        "s3_request_concurrency": {"limit": limit},
        "gcs_request_retries": retries,
        "s3_request_retries": retries,
        "cache_pool": {"total_bytes_limit": options.cache_bytes},
    }


_HINTS = {
    "PERMISSION_DENIED": "access denied: check the credentials and their permissions",
    "UNAUTHENTICATED": "not authenticated: check the credentials",
    "NOT_FOUND": "an object of the store is missing (the store is incomplete or was deleted)",
    "DEADLINE_EXCEEDED": "the server did not answer in time",
    "DATA_LOSS": (
        "stored bytes fail their crc32c checksum (the file named below is corrupt): "
        "restore it, or write the dataset again"
    ),
}


def store_error(url: str, error: BaseException, options: StoreOptions) -> StoreError:
    """A :class:`StoreError` for a tensorstore failure at ``url``, saying what to check."""
    text = str(error)
    code = text.split(":", 1)[0]
    if isinstance(error, TimeoutError):
        hint = f"no answer within StoreOptions.timeout={options.timeout}s"
    elif "No space left on device" in text or "os_error_code='28'" in text:
        hint = "no space left on device: free space there, or write elsewhere"
    elif code in _HINTS:
        hint = _HINTS[code]
    elif "retry attempts failed" in text and any(
        f"http_response_code='{status}'" in text for status in ("429", "503")
    ):
        hint = (
            f"the store refused the request as throttled (HTTP 429 or 503) in all "
            f"{options.retries} attempts (StoreOptions.retries, StoreOptions.retry_delay, "
            "StoreOptions.max_retry_delay): raise StoreOptions.retries (at most "
            f"{MAX_RETRIES}), or need fewer requests per second (a bucket's rate grows "
            "with time)"
        )
    elif "retry attempts failed" in text or code in ("UNAVAILABLE", "ABORTED"):
        hint = (
            f"the server failed {options.retries} attempts (StoreOptions.retries, "
            "StoreOptions.retry_delay, StoreOptions.max_retry_delay): is it reachable?"
        )
    else:
        hint = "the read or write failed"
    return StoreError(f"{redact(url)}: {hint}: {redact_text(text)}")


def wait(future: Any, url: str, options: StoreOptions) -> Any:
    """``future.result()`` within ``options.timeout``; failures as :class:`StoreError`."""
    try:
        return future.result(timeout=options.timeout)
    except (ValueError, TimeoutError) as e:
        raise store_error(url, e, options) from e
