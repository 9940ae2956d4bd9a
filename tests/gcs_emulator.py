"""A local Google Cloud Storage emulator for the tests (the ``gcp-storage-emulator`` package): a
subprocess on 127.0.0.1 with a free port, its objects on disk so that it can be stopped in the
middle of a write and started again on the same port with what it held (a fault on the way to the
bucket). ``environment()`` is what points every client bertjax uses at it: the one variable the
Cloud clients share, ``STORAGE_EMULATOR_HOST``, and what ``bertjax.fs.cloud_environment`` derives
from it.

Run as a script, this file is the emulator with what TensorStore (Orbax's checkpoints) needs of GCS
and the package leaves out (``serve``): a download names its object's generation
(``x-goog-generation``; TensorStore fails with "Malformed StorageGeneration" without it), and the
generation preconditions (``ifGenerationMatch`` on writes, ``ifGenerationNotMatch`` on reads) are
honoured as GCS does; a multipart upload (gcsfs's, for small objects) keeps its content byte for
byte (the package's parser dropped a final carriage return: 1 object in 256). Faults, armed while
it runs (``Emulator.fail``, through its ``/_faults`` endpoint): the next requests matching a
method, bucket and object name answer an HTTP error (429, 503: what GCS answers when it is
overloaded; 403: a bucket this account may not write), or the process dies at one of them without a
reply and before storing anything (a fault in the middle of a write). Every object deleted is
appended to ``deletions.log`` beside the data (the order in which a client removed things)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from bertjax import fs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts the emulator (again, on the same port and data after ``stop``), with no fault."""
        os.makedirs(self.data_dir, exist_ok=True)
        self._log = open(os.path.join(self.data_dir, "..", "emulator.log"), "ab")  # noqa: SIM115
        env = {**os.environ, "STORAGE_BASE": self.data_dir, "STORAGE_DIR": "store"}
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.port)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = os.path.join(self.data_dir, "..", "emulator.log")
                    raise RuntimeError(f"the GCS emulator did not start (see {log})") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Kills the emulator (SIGKILL: a fault, not a shutdown)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def deletions(self) -> list[str]:
        """The objects deleted so far, in order (``bucket/name``)."""
        path = os.path.join(self.data_dir, "..", "deletions.log")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()

    def fail(
        self,
        status: int | str,
        times: int | None = 1,
        *,
        method: str | None = None,
        bucket: str | None = None,
        name: str | None = None,
        agent: str | None = None,
        after: int = 0,
    ) -> None:
        """Arms a fault: of the requests with this ``method`` (GET, POST, ...), in this ``bucket``
        (``NAME`` or ``gs://NAME``), with an object name (or listing prefix) that the regular
        expression ``name`` finds and from a client whose User-Agent ``agent`` finds (e.g.
        "TensorStore", "gcsfs"; each left out: any), the first ``after`` are served and the next
        ``times`` (None: every one from then on) answer HTTP ``status`` with GCS's JSON error
        body; ``status="die"``: the process dies at the first of them, without a reply."""
        fault = {"status": status, "times": times, "method": method, "name": name, "after": after}
        fault.update(bucket=bucket.split("://", 1)[-1] if bucket else None, agent=agent)
        self._faults("POST", fault)

    def faults(self) -> list[dict]:
        """The armed faults with ``seen`` (requests matched) and ``sent`` (errors answered)."""
        return self._faults("GET")

    def clear_faults(self) -> None:
        self._faults("DELETE")

    def _faults(self, method: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/_faults",
            data=data,
            headers={"Content-Type": "application/json"},
            method=method,
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read() or b"null")

    def kill_during_upload(self, name_part: str, down_s: float = 1.0) -> threading.Thread:
        """Arms the emulator to die at the first upload of an object whose name holds
        ``name_part``, then, ``down_s`` seconds after it died, starts it again (same port, same
        data, no fault). Returns the watching thread (join it: it ends once restarted)."""
        self.fail("die", method="POST", name=re.escape(name_part))
        process = self.process

        def watch():
            process.wait()
            time.sleep(down_s)
            self.stop()
            self.start()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    def create_bucket(self, name: str) -> str:
        """Creates bucket ``name``; returns ``gs://name``."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).read()
        return f"gs://{name}"

    def environment(self) -> dict[str, str]:
        env = {"STORAGE_EMULATOR_HOST": self.url}
        env.update(fs.cloud_environment(env))
        return env


def start(root: str) -> Emulator:
    shutil.rmtree(root, ignore_errors=True)
    emulator = Emulator(os.path.join(root, "data"))
    emulator.start()
    return emulator


def _generation(storage, bucket: str, name: str | None) -> str:
    """The object's generation, "0" when it does not exist (as GCS preconditions count)."""
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"]) if name else "0"
    except NotFound:
        return "0"


_OBJECT = re.compile(r"/b/(?P<bucket>[^/]+)(?:/o(?:/(?P<name>.+))?)?$")


def _target(request) -> tuple[str | None, str | None]:
    """(bucket, object name) of a JSON-API request: the name from the path, the query (``name``,
    or a listing's ``prefix``) or a multipart upload's metadata."""
    from urllib.parse import unquote

    found = _OBJECT.search(request.path)
    if found is None:
        return None, None
    name = unquote(found["name"]) if found["name"] else None
    for key in ("name", "prefix"):
        name = name or (request.query.get(key) or [None])[0]
    if name is None and request.method == "POST" and isinstance(request.data, dict):
        name = (request.data.get("meta") or {}).get("name")
    return found["bucket"], name


class _Faults:
    """The armed faults (``Emulator.fail``); the server is one thread, the lock is for clarity."""

    def __init__(self):
        self.armed: list[dict] = []
        self.lock = threading.Lock()

    def control(self, request, response, storage):
        with self.lock:
            if request.method == "POST":
                fault = request.data  # JSON: a dict
                self.armed.append({**fault, "seen": 0, "sent": 0})
            elif request.method == "DELETE":
                self.armed.clear()
            response.json(self.armed)

    def take(self, request) -> dict | None:
        """The fault this request meets, counted; None when it is to be served."""
        bucket, name = _target(request)
        with self.lock:
            for fault in self.armed:
                if fault["method"] not in (None, request.method):
                    continue
                if fault["bucket"] not in (None, bucket):
                    continue
                if fault["name"] is not None and not (name and re.search(fault["name"], name)):
                    continue
                agent = request.get_header("User-Agent", "")
                if fault["agent"] is not None and not re.search(fault["agent"], agent, re.I):
                    continue
                fault["seen"] += 1
                if fault["seen"] <= fault["after"]:
                    continue
                if fault["times"] is not None and fault["sent"] >= fault["times"]:
                    continue
                fault["sent"] += 1
                return fault
        return None

    def wrap(self, handler):
        from http import HTTPStatus

        def faulty(request, response, storage, *args, **kwargs):
            fault = self.take(request)
            if fault is None:
                return handler(request, response, storage, *args, **kwargs)
            if fault["status"] == "die":
                os._exit(1)  # no reply, nothing stored
            request.data  # noqa: B018  (the body read: the client sees the answer, not a reset)
            status = HTTPStatus(int(fault["status"]))
            response.status = status
            response.json({"error": {"code": status.value, "message": f"{status.phrase} (fault)"}})

        return faulty


def _multipart_exactly(read_data):
    """The package's request-body reader, with ``multipart/related`` uploads split at their
    boundary on bytes. A part is a line break, headers, an empty line, the content and the line
    break of the next boundary line, each break as the client frames them: CRLF (RFC 2046) or LF
    (gcsfs). The package's e-mail parser takes any CR before gcsfs's LF for part of the break."""
    from email.message import Message

    from gcp_storage_emulator import server

    def content(part: bytes) -> tuple[bytes, bytes]:
        eol = b"\r\n" if part.startswith(b"\r\n") else b"\n"
        headers, _, body = part[len(eol) :].partition(eol + eol)
        if not body.endswith(eol):
            raise ValueError("a multipart part does not end with a line break")
        return headers, body[: -len(eol)]

    def read(request_handler, query):
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return read_data(request_handler, query)
        raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
        header = Message()
        header["Content-Type"] = content_type
        boundary = b"--" + header.get_param("boundary").encode()
        # The content may hold the boundary string: it ends at the last one.
        _, first, rest = raw.split(boundary, 2)
        (_, meta), (headers, data) = content(first), content(rest[: rest.rindex(boundary)])
        types = re.search(rb"(?im)^content-type:[ \t]*([^;\r\n]+)", headers)
        return {
            "meta": json.loads(meta),
            "content": data,
            "content-type": types[1].decode().strip() if types else "application/octet-stream",
        }

    return read


def serve(port: int) -> None:
    """The emulator on 127.0.0.1:PORT (objects under $STORAGE_BASE/$STORAGE_DIR), patched as the
    module docstring says."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download, insert, delete = objects.download, objects.insert, objects._delete
    deletions = os.path.join(os.environ["STORAGE_BASE"], "..", "deletions.log")
    faults = _Faults()

    def delete_and_record(storage, bucket_name, object_id):
        deleted = delete(storage, bucket_name, object_id)
        if deleted:
            with open(deletions, "a", encoding="utf-8") as f:
                f.write(f"{bucket_name}/{object_id}\n")
        return deleted

    def download_with_generation(request, response, storage, *args, **kwargs):
        bucket, name = request.params["bucket_name"], request.params["object_id"]
        generation = _generation(storage, bucket, name)
        unless = request.query.get("ifGenerationNotMatch", [None])[0]
        if generation != "0" and unless == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return
        if generation != "0":
            response["x-goog-generation"] = generation
            response["x-goog-metageneration"] = "1"
        return download(request, response, storage, *args, **kwargs)

    def insert_if_generation_matches(request, response, storage, *args, **kwargs):
        expected = request.query.get("ifGenerationMatch", [None])[0]
        if expected is not None:
            _, name = _target(request)
            if _generation(storage, request.params["bucket_name"], name) != expected:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return
        return insert(request, response, storage, *args, **kwargs)

    objects.download = download_with_generation  # objects.get (alt=media) calls it by name
    objects._delete = delete_and_record  # objects.delete and batch deletes call it by name
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is download:
                handler = download_with_generation
            elif handler is insert:
                handler = insert_if_generation_matches
            methods[method] = faults.wrap(handler)
    objects.insert = faults.wrap(insert_if_generation_matches)  # the router's upload fallback
    control = {m: faults.control for m in ("GET", "POST", "DELETE")}
    server.HANDLERS = ((r"^/_faults$", control), *server.HANDLERS)
    server._read_data = _multipart_exactly(server._read_data)
    server.create_server("127.0.0.1", port).run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
