"""File-system calls: the standard library for local paths, gcsfs (fsspec) for ``gs://`` and
``tf.io.gfile`` for other schemes (s3://, ...), so that code working on local files (data
preparation) never imports TensorFlow.

``gs://`` goes through gcsfs because it honours ``STORAGE_EMULATOR_HOST`` (a local GCS emulator,
as the tests use) and Application Default Credentials on a TPU VM alike; TensorFlow's own GCS
filesystem cannot be pointed at an emulator. ``cloud_environment`` names the variables that point
the other clients (Orbax's etils and TensorStore) the same way."""

from __future__ import annotations

import errno
import glob as glob_lib
import io
import json
import os
import shutil
from collections.abc import Mapping
from typing import IO

GCS_SCHEMES = ("gs://", "gcs://")


def is_remote(path: str) -> bool:
    """True for a path with a scheme (gs://, s3://, ...)."""
    return "://" in str(path)


def is_gcs(path: str) -> bool:
    """True for a ``gs://`` path (handled by gcsfs)."""
    return str(path).startswith(GCS_SCHEMES)


def bucket(path: str) -> str | None:
    """The bucket of a ``gs://`` path (``gs://NAME``), None for any other path."""
    if not is_gcs(path):
        return None
    scheme, rest = str(path).split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def cloud_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables (not already in ``environ``) that point every client bertjax uses for
    ``gs://`` the same way: Orbax's paths (etils) through fsspec/gcsfs rather than TensorFlow's
    GCS filesystem, and, when ``STORAGE_EMULATOR_HOST`` names an emulator, TensorStore's
    endpoint too, with no metadata-server probe and no gRPC bucket-layout lookup (which an
    emulator does not serve). The ``bertjax`` command applies them; a library caller may."""
    wanted = {"EPATH_USE_TF": "false"}
    host = environ.get("STORAGE_EMULATOR_HOST", "")
    if host and host != "default":
        url = host if host.startswith(("http://", "https://")) else f"http://{host}"
        wanted.update(
            TENSORSTORE_GCS_HTTP_URL=url,
            GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
            NO_GCE_CHECK="true",
            GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
        )
    return {key: value for key, value in wanted.items() if key not in environ}


def register_gcs() -> None:
    """Makes ``bertjax.gcs.FileSystem`` (gcsfs with bertjax's retries) fsspec's filesystem for
    ``gs://`` and ``gcs://`` in this process, so that Orbax's paths (etils through fsspec) retry as
    ``bertjax.fs`` does. Process-wide: the ``bertjax`` command calls it, the library does not."""
    import fsspec
    from fsspec.registry import registry

    for protocol in ("gs", "gcs"):
        if protocol in registry:  # gcsfs already imported: the class itself
            from bertjax import gcs

            fsspec.register_implementation(protocol, gcs.FileSystem, clobber=True)
        else:  # imported at the first gs:// path
            fsspec.register_implementation(protocol, "bertjax.gcs.FileSystem", clobber=True)


def _gcs():
    """The gcsfs filesystem (cached by fsspec per endpoint) with bertjax's retries
    (``bertjax.gcs``): the plain JSON-API client, without the experimental zonal/hierarchical-bucket
    detection, whose gRPC lookup an emulator cannot answer. Credentials: Application Default
    Credentials (a TPU VM's service account)."""
    from bertjax import gcs  # gs:// paths only (it imports gcsfs)

    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "default") != "default"
    return gcs.FileSystem(
        endpoint_url=os.environ["STORAGE_EMULATOR_HOST"] if emulator else None,
        token="anon" if emulator else None,  # an emulator takes no credentials
        use_listings_cache=False,
    )


def _gfile():
    import tensorflow as tf  # other remote schemes only

    return tf.io.gfile


def open_file(path: str, mode: str = "rb") -> IO:
    """A file object (binary modes: "rb", "wb"; text: "r", "w" as UTF-8). A remote file written
    is visible only once closed (one upload)."""
    if is_gcs(path):
        f = _gcs().open(path, mode.replace("b", "") + "b")
        return f if "b" in mode else io.TextIOWrapper(f, encoding="utf-8")
    if is_remote(path):
        return _gfile().GFile(path, mode)
    return open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))  # noqa: SIM115


def exists(path: str) -> bool:
    if is_gcs(path):
        return _gcs().exists(path)
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def _gcs_kind(path: str) -> str | None:
    """ "file", "directory" or None (absent) of a gs:// path; unlike gcsfs's isdir/isfile, a
    request that fails raises rather than answering False."""
    try:
        return _gcs().info(path)["type"]
    except FileNotFoundError:
        return None


def isdir(path: str) -> bool:
    if is_gcs(path):
        return _gcs_kind(path) == "directory"
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    if is_gcs(path):
        return _gcs_kind(path) == "file"
    if is_remote(path):
        return _gfile().exists(path) and not _gfile().isdir(path)
    return os.path.isfile(path)


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` in one go: on ``gs://`` one upload, so the object appears whole or not at
    all (local paths: not atomic, see ``bertjax.atomic``)."""
    if is_gcs(path):
        _gcs().pipe_file(path, data)
        return
    with open_file(path, "wb") as f:
        f.write(data)


def glob(pattern: str) -> list[str]:
    if is_gcs(pattern):
        scheme = pattern.split("://", 1)[0]
        return [f"{scheme}://{p}" for p in _gcs().glob(pattern)]
    return _gfile().glob(pattern) if is_remote(pattern) else glob_lib.glob(pattern)


def remove(path: str) -> None:
    if is_gcs(path):
        _gcs().rm_file(path)
    elif is_remote(path):
        _gfile().remove(path)
    else:
        os.remove(path)


def makedirs(path: str) -> None:
    """Creates a folder and its parents (nothing on ``gs://``, whose folders are prefixes)."""
    if is_gcs(path):
        return
    if is_remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def size(path: str) -> int:
    if is_gcs(path):
        return int(_gcs().size(path))
    return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def rename(source: str, target: str) -> None:
    """Renames, replacing target (atomic for local paths; on ``gs://`` a copy then a delete, as
    object stores have no rename)."""
    if is_gcs(source) and is_gcs(target):
        gcs = _gcs()
        gcs.copy(source, target)
        gcs.rm_file(source)
    elif is_remote(source) or is_remote(target):
        _gfile().rename(source, target, overwrite=True)
    else:
        os.replace(source, target)


def rmtree(path: str) -> None:
    if is_gcs(path):
        gcs = _gcs()
        if gcs.exists(path):
            gcs.rm(path, recursive=True)
    elif is_remote(path):
        if _gfile().exists(path):
            _gfile().rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def list_files(folder: str) -> list[str]:
    """Every file under ``folder``, recursively, as sorted paths relative to it ("a/b.json"); none
    when it does not exist."""
    folder = str(folder).rstrip("/")
    if is_gcs(folder):
        gcs = _gcs()
        if not isdir(folder):
            return []
        inside = folder.split("://", 1)[1] + "/"
        found = gcs.find(folder)
        return sorted(p[len(inside) :] for p in found if p.startswith(inside))
    if is_remote(folder):
        gfile = _gfile()
        if not gfile.isdir(folder):
            return []
        return sorted(
            f"{root}/{name}"[len(folder) + 1 :]
            for root, _, names in gfile.walk(folder)
            for name in names
        )
    return sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for root, _, names in os.walk(folder)
        for name in names
    )


def download(source: str, target: str) -> None:
    """Copies the file ``source`` (any scheme) to the local path ``target``, its folders made."""
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    if is_gcs(source):
        _gcs().get_file(source, target)
        return
    with open_file(source, "rb") as f, open(target, "wb") as out:
        shutil.copyfileobj(f, out)


def upload(source: str, target: str) -> None:
    """Copies the local file ``source`` to ``target`` (any scheme): on ``gs://`` one object, whole
    or not at all."""
    if is_gcs(target):
        _gcs().put_file(source, target)
        return
    with open(source, "rb") as f, open_file(target, "wb") as out:
        shutil.copyfileobj(f, out)


def not_found_errors(path: str) -> tuple[type[BaseException], ...]:
    """What reading a missing ``path`` raises (other remote schemes: TensorFlow's NotFoundError
    too)."""
    if is_remote(path) and not is_gcs(path):
        import tensorflow as tf  # other remote schemes only

        return (FileNotFoundError, tf.errors.NotFoundError)
    return (FileNotFoundError,)


def io_errors(path: str) -> tuple[type[BaseException], ...]:
    """What a failed read or write of ``path`` raises (gs://: gcsfs's HttpError too; other remote
    schemes: TensorFlow's OpError)."""
    if is_gcs(path):
        from gcsfs.retry import HttpError  # gs:// paths only

        return (OSError, HttpError)
    if is_remote(path):
        import tensorflow as tf  # other remote schemes only

        return (OSError, tf.errors.OpError)
    return (OSError,)


_REFUSALS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def write_refusal(path: str, err: BaseException) -> str | None:
    """Why writing ``path`` failed when its file system refuses writes there ("read-only file
    system", "permission denied", ...); None for any other failure (a full disk, a bad path)."""
    if isinstance(err, OSError):
        if is_gcs(path) and str(err).startswith("Forbidden"):  # gcsfs: HTTP 403
            return "permission denied"
        return _REFUSALS.get(err.errno)
    if is_remote(path) and not is_gcs(path):
        import tensorflow as tf  # remote paths only

        if isinstance(err, tf.errors.PermissionDeniedError):
            return "permission denied"
    return None


def utf8_error(path: str | os.PathLike, err: UnicodeDecodeError) -> ValueError:
    """The one-line error for a text file that is not UTF-8: ``path:line: not valid UTF-8``,
    naming the first bad line (a decoder's ``err`` only knows an offset in its buffer)."""
    path = os.fspath(path)
    with open_file(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return ValueError(f"{path}:{number}: not valid UTF-8 ({bad.reason})")
    return ValueError(f"{path}: not valid UTF-8 ({err.reason})")


def json_error(path: str | os.PathLike, err: ValueError, line: int | None = None) -> ValueError:
    """The one-line error for text that is not JSON: ``path:line: invalid JSON at column C: why``.
    ``line``: the file's line of a JSON-lines record (its columns counted in the record, a record
    cut short ending at its last character); without it, the decoder's line of a whole file."""
    path = os.fspath(path)
    if not isinstance(err, json.JSONDecodeError):  # e.g. bytes that are not UTF-8
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return ValueError(f"{path}{'' if line is None else f':{line}'}: invalid JSON: {reason}")
    if line is None:
        line, column = err.lineno, err.colno
    else:
        column = min(err.pos, len(err.doc.rstrip("\r\n"))) + 1
    return ValueError(f"{path}:{line}: invalid JSON at column {column}: {err.msg}")


def missing_folders(path: str) -> list[str]:
    """The folders ``makedirs(path)`` would create, ``path`` first, then its missing parents (none
    for a remote path, whose folders are not things of their own)."""
    if is_remote(path):
        return []
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_empty_folders(folders: list[str]) -> None:
    """Removes each of ``folders`` (deepest first, as ``missing_folders`` lists them) that holds
    nothing but empty folders; the first that holds anything is kept, and so are the rest. Only
    empty folders are ever removed (``os.rmdir``): never a file, whoever wrote it."""
    for folder in folders:
        for root, _, _ in os.walk(folder, topdown=False):
            try:
                os.rmdir(root)
            except OSError:  # not empty (a file, a link, a folder holding one) or already gone
                pass
        if os.path.lexists(folder):
            return
