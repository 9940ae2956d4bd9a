"""gs:// through gcsfs with one retry policy, and the error that ends it.

Cloud Storage asks its clients to retry a request answered 408, 429 or 5xx, or cut off, with
truncated exponential backoff and jitter, until a deadline
(https://cloud.google.com/storage/docs/retry-strategy). gcsfs does, with a fixed six tries over
about 31 s. :class:`FileSystem` (what ``bertjax.fs`` uses for ``gs://``; Orbax's own gs:// files
too once ``bertjax.fs.register_gcs`` has run, as the ``bertjax`` command runs it) retries instead
by :class:`RetryPolicy`: waits of ``backoff_s``, twice that, four times, ... capped at 32 s, each
plus up to ``backoff_s`` of jitter, for as long as the next try still starts within ``seconds`` of
the first. Then the request fails with :class:`Unavailable`, an ``OSError`` whose one line
names the object (``gs://BUCKET/NAME``), how long it was tried and the last answer. The
environment sets the policy of every process of a job alike: ``BERTJAX_GCS_RETRY_SECONDS``
(default 120, the Cloud client libraries' deadline) and ``BERTJAX_GCS_BACKOFF_SECONDS`` (default
1); a value that is not a number of seconds is a one-line error, never ignored.

A request refused (HTTP 403: this account may not read or write there) is not retried; it fails
with a ``PermissionError`` naming the object too.

TensorStore (the arrays of Orbax's checkpoints) counts retries instead of seconds: its
``gcs_request_retries`` context resource (by default 32 retries, waits from 1 s doubling up to
32 s: about a quarter of an hour). :meth:`RetryPolicy.tensorstore_retries` is this policy in those
terms, the retries whose waits fit in ``seconds``; bertjax's checkpoints write their arrays with it
(``bertjax.checkpointing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import random
import re
import time
from collections.abc import Mapping
from urllib.parse import parse_qs, unquote, urlparse

from gcsfs.core import GCSFileSystem
from gcsfs.retry import HttpError, is_retriable

log = logging.getLogger(__name__)


class Unavailable(OSError):
    """A request to a bucket that still failed when its retries ran out: one line naming the
    object, how long it was tried and the last answer."""


RETRY_SECONDS = "BERTJAX_GCS_RETRY_SECONDS"
BACKOFF_SECONDS = "BERTJAX_GCS_BACKOFF_SECONDS"
MAX_WAIT_S = 32.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    seconds: float = 120.0  # no try starts later than this after the first
    backoff_s: float = 1.0  # the first wait, doubled after each try (and the jitter's range)

    def wait(self, retry: int, rng=random) -> float:
        """Seconds to wait before retry ``retry`` (0 for the first retry)."""
        return min(self.backoff_s * 2**retry, MAX_WAIT_S) + rng.uniform(0, self.backoff_s)

    def tensorstore_retries(self) -> dict:
        """This policy as TensorStore's ``gcs_request_retries`` context resource: the same waits
        (jitter aside) for as many retries as fit in ``seconds``, at most TensorStore's 32."""
        retries, waited = 0, 0.0
        while retries < 32:
            waited += min(self.backoff_s * 2**retries, MAX_WAIT_S)
            if waited > self.seconds:
                break
            retries += 1
        first, most = (f"{round(s * 1e9)}ns" for s in (self.backoff_s, MAX_WAIT_S))
        return {"max_retries": retries, "initial_delay": first, "max_delay": most}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> RetryPolicy:
        """The policy ``BERTJAX_GCS_RETRY_SECONDS`` and ``BERTJAX_GCS_BACKOFF_SECONDS`` set."""
        values = {}
        for field, name in (("seconds", RETRY_SECONDS), ("backoff_s", BACKOFF_SECONDS)):
            text = environ.get(name, "").strip()
            if not text:
                continue
            try:
                values[field] = float(text)
            except ValueError:
                values[field] = -1.0
            if not values[field] >= 0.0:  # also NaN
                raise ValueError(f"{name}={text!r}: not a number of seconds (0 or more)")
        return cls(**values)


def _transient(err: BaseException) -> bool:
    """Whether Cloud Storage asks for ``err``'s request to be tried again (gcsfs's judgement,
    plus a request that timed out)."""
    if isinstance(err, HttpError) and err.code == 404:
        return False
    return is_retriable(err) or isinstance(err, TimeoutError)


_OBJECT = re.compile(r"/b/(?P<bucket>[^/]+)(?:/o(?:/(?P<name>[^?]+))?)?$")
_UPLOADED_NAME = re.compile(rb'^\{"name": ("(?:[^"\\]|\\.)*")', re.M)


def _object(url: str, params: Mapping, data) -> str:
    """``gs://BUCKET/NAME`` of a JSON-API request: the name from its path, its query (``name``, a
    listing's ``prefix``) or a multipart upload's metadata; the URL's path when there is none."""
    parsed = urlparse(url)
    found = _OBJECT.search(parsed.path)
    if found is None:
        return parsed.path
    query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    query.update({k: str(params[k]) for k in ("name", "prefix") if params.get(k) is not None})
    name = unquote(found["name"]) if found["name"] else query.get("name") or query.get("prefix")
    if name is None and isinstance(data, (bytes, bytearray)):
        uploaded = _UPLOADED_NAME.search(bytes(data[:4096]))
        name = json.loads(uploaded[1]) if uploaded else None
    return f"gs://{found['bucket']}/{name or ''}".rstrip("/")


async def _retrying(call, what, *args, **kwargs):
    """``await call(*args, **kwargs)``, retried by the environment's policy (module docstring);
    ``what()`` names the request in the error."""
    policy = RetryPolicy.from_environment()
    start = time.monotonic()
    for retry in itertools.count():
        try:
            return await call(*args, **kwargs)
        except Exception as err:  # noqa: BLE001  (what is not transient is raised as it is)
            if not _transient(err):
                raise
            wait = policy.wait(retry)
            elapsed = time.monotonic() - start
            if elapsed + wait > policy.seconds:
                last = " ".join(str(err).split()) or type(err).__name__
                raise Unavailable(
                    f"{what()}: Cloud Storage failed {retry + 1} tries in {elapsed:.1f} s (the "
                    f"last: {last}); {RETRY_SECONDS}={policy.seconds:g} sets how long to retry"
                ) from err
            log.debug("%s: %s; trying again in %.2f s", what(), err, wait)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


_REQUEST = GCSFileSystem._request.__wrapped__  # gcsfs's request, without its own retries
_GET_FILE = GCSFileSystem._get_file_request.__wrapped__


class FileSystem(GCSFileSystem):
    """gcsfs with :class:`RetryPolicy` in place of its own retries."""

    async def _request(self, method, path, *args, **kwargs):
        def what():
            return _object(self._format_path(path, args), kwargs, kwargs.get("data"))

        try:
            return await _retrying(_REQUEST, what, self, method, path, *args, **kwargs)
        except OSError as err:  # gcsfs's HTTP 403: "Forbidden: URL\nmessage"
            if type(err) is not OSError or not str(err).startswith("Forbidden: "):
                raise
            message = " ".join(str(err).split("\n", 1)[-1].split())
            # "Forbidden" first still: gcsfs itself falls back from a 403 by that word
            raise PermissionError(f"Forbidden: {what()} (HTTP 403: {message})") from None

    async def _get_file_request(self, rpath, lpath, *args, **kwargs):
        def what():
            return f"gs://{self._strip_protocol(rpath)}"

        return await _retrying(_GET_FILE, what, self, rpath, lpath, *args, **kwargs)
