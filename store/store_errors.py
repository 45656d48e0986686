"""What an object store's refusal or silence becomes: one error line naming the URL and the
problem, with the exit code it belongs to (docs/reliability.md, "Object-store failures").

    the bucket does not exist                BucketNotFoundError    exit 2 (the URL is wrong)
    invalid credentials, or none found       StoreAccessError       exit 1
    access denied (a policy refuses it)      StoreAccessError       exit 1
    no answer within the retry budget        StoreUnreachableError  exit 1
    anything else the store answers          StorageError           exit 1

obstore's errors carry the HTTP status, the store's error code (S3's `<Code>`), the request's
URL and the retries in their text, followed by a debug dump: the line is built from those
parts, never from the dump. How long a request is retried is `retry_config()`: bounded by
GROUPFORGE_STORE_RETRY_TIMEOUT, so an unreachable endpoint fails in seconds, not minutes.
Light: no obstore import at module level.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

from store.errors import JobError, first_line

RETRY_ENV = "GROUPFORGE_STORE_RETRY_TIMEOUT"
"""Seconds a failing object-store request is retried before the job stops (default below)."""
RETRY_SECONDS = 20.0
MAX_BACKOFF_SECONDS = 4.0
"""The longest wait between two tries: the last try starts before RETRY_SECONDS + this."""

CREDENTIAL_VARS = {
    "s3": "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN",
    "gs": "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS",
    "az": "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY",
}
ENDPOINT_VARS = {"s3": "AWS_ENDPOINT_URL", "gs": "GOOGLE_CLOUD_STORAGE_URL", "az": "AZURE_STORAGE_ENDPOINT"}
SCHEME_FAMILY = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az",
                 "azure": "az"}

MISSING_BUCKET_CODES = ("NoSuchBucket", "ContainerNotFound")
BAD_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                        "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidClientTokenId",
                        "AuthenticationFailed", "InvalidAuthenticationInfo")
UNREACHABLE_SIGNS = ("error sending request", "tcp connect error", "Connection refused", "dns error",
                     "timed out", "operation timed out", "connection closed", "Connection reset")
METADATA_SIGNS = ("169.254.169.254", "/latest/api/token", "/latest/meta-data/")
"""The cloud instance-metadata service (its address, its paths): obstore asks it for credentials
when none are set."""


class StorageError(JobError):
    """An object store refused or failed a request (exit 1); the message names the URL and the
    store's reason."""


class StoreAccessError(StorageError):
    """The store refused the credentials (invalid, expired, none found) or the action (access
    denied by a policy). Nothing after the refused request was written."""


class StoreUnreachableError(StorageError):
    """No answer from the store's endpoint within the retry budget (GROUPFORGE_STORE_RETRY_TIMEOUT)."""


class BucketNotFoundError(StorageError, ValueError):
    """The URL names a bucket (or container) that does not exist: bad input, exit 2. groupforge
    never creates a bucket: that is an account's decision (region, billing, access)."""


def retry_config() -> dict:
    """obstore's RetryConfig: retry for at most GROUPFORGE_STORE_RETRY_TIMEOUT seconds (default
    20), waiting at most 4 s between tries; obstore's own default retries for 3 minutes."""
    text = os.environ.get(RETRY_ENV)
    try:
        seconds = RETRY_SECONDS if text is None else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{RETRY_ENV}={text}: expected a number of seconds > 0")
    return {"retry_timeout": timedelta(seconds=seconds),
            "backoff": {"max_backoff": timedelta(seconds=min(MAX_BACKOFF_SECONDS, seconds))}}


def store_error(root: str, where: str, action: str, exc: BaseException, took: float | None = None
                ) -> StorageError:
    """The error for obstore's (or deltalake's) `exc` raised while `action` ("reading",
    "writing", "listing", ...) the object `where` of the storage at URL `root` (see the module
    docstring); `took`: the seconds the failed call took, where its message does not say."""
    text = str(exc)
    first = first_line(exc)
    code = _match(r"<Code>([^<]+)</Code>", text)
    message = _match(r"<Message>([^<]+)</Message>", text)
    status = _match(r"status code: (\d{3})", first) or _match(r"status: (\d{3})", text)
    family = SCHEME_FAMILY.get(root.partition("://")[0].lower(), "s3")
    said = f"{code}: {message}" if code and message else code or (f"HTTP {status}" if status else "")
    if code in MISSING_BUCKET_CODES or "specified bucket does not exist" in text:
        bucket = root.partition("://")[2].split("/", 1)[0]
        return BucketNotFoundError(f"{root}: the bucket {bucket!r} does not exist{_at(text, family)}: create it, "
                                   "or give the URL of an existing one")
    if code in BAD_CREDENTIAL_CODES or status == "401":
        return StoreAccessError(f"{where}: {action} refused: invalid credentials ({said}): check "
                                f"{CREDENTIAL_VARS[family]}, then rerun the same command")
    if any(sign in first for sign in METADATA_SIGNS) or "credential" in first.lower() or \
            "while loading credentials" in text:  # deltalake's words, below its first line
        return StoreAccessError(f"{where}: {action} failed: no credentials found (set {CREDENTIAL_VARS[family]}; "
                                f"without them the instance-metadata service was asked): {_short(first)}")
    if status == "403" or type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return StoreAccessError(f"{where}: {action} refused: access denied ({said or 'HTTP 403'}): the "
                                "credentials in use may not do this; grant it (or use credentials that may), "
                                "then rerun the same command, which resumes")
    if any(sign in text for sign in UNREACHABLE_SIGNS):
        return StoreUnreachableError(f"{where}: {action} failed: cannot reach the object store{_at(text, family)}: "
                                     f"{_why_unreachable(text)}, {_retried(first, took)}; check the endpoint and the "
                                     "network, then rerun the same command, which resumes")
    return StorageError(f"{where}: {action} failed: {_short(first)}")


def _match(pattern: str, text: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


def _short(line: str) -> str:
    return line if len(line) <= 300 else line[:300] + "..."


def _at(text: str, family: str) -> str:
    """" at <endpoint> (<its variable>)" from the request URL in obstore's message, or ""."""
    endpoint = _match(r"(https?://[^/\s?]+)", text)
    return f" at {endpoint} ({ENDPOINT_VARS[family]})" if endpoint else ""


def _why_unreachable(text: str) -> str:
    """Connection refused, a DNS failure, a timeout: the OS's or the client's words."""
    os_message = _match(r'message: "([^"]+)"', text)
    if os_message:
        return os_message.lower()
    for sign in ("dns error", "timed out", "connection closed", "Connection reset"):
        if sign in text:
            return sign.lower()
    return "no answer"


def _retried(first: str, took: float | None = None) -> str:
    """"gave up after 20.1 s and 9 retries" from obstore's first line (or `took`)."""
    said = re.search(r" in ([0-9.]+)(ms|s)\b", first)
    seconds = float(said[1]) / (1000 if said[2] == "ms" else 1) if said else took
    retries = _match(r"after (\d+) retries", first)
    return (f"gave up after {seconds:.1f} s" if seconds is not None else "gave up") + \
        (f" and {retries} retries" if retries else "") + f" ({RETRY_ENV} sets how long)"
