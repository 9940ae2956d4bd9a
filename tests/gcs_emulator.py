"""A local Google Cloud Storage emulator for the tests (the ``gcp-storage-emulator`` package): a
subprocess on 127.0.0.1 with a free port, its objects on disk so that it can be stopped in the
middle of a write and started again on the same port with what it held (a fault on the way to the
bucket). ``environment()`` is what points every client bertjax uses at it: the one variable the
Cloud clients share, ``STORAGE_EMULATOR_HOST``, and what ``bertjax.fs.cloud_environment`` derives
from it.

Run as a script, this file is the emulator with what TensorStore (Orbax's checkpoints) needs of
GCS and the package leaves out (``serve``): a download names its object's generation
(``x-goog-generation``; TensorStore fails with "Malformed StorageGeneration" without it), and the
generation preconditions (``ifGenerationMatch`` on writes, ``ifGenerationNotMatch`` on reads) are
honoured as GCS does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
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
        """Starts the emulator (again, on the same port and data after ``stop``)."""
        os.makedirs(self.data_dir, exist_ok=True)
        self._log = open(os.path.join(self.data_dir, "..", "emulator.log"), "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.port)],
            env={**os.environ, "STORAGE_BASE": self.data_dir, "STORAGE_DIR": "store"},
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


def serve(port: int) -> None:
    """The emulator on 127.0.0.1:PORT (objects under $STORAGE_BASE/$STORAGE_DIR), patched as the
    module docstring says."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download, insert = objects.download, objects.insert

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
            name = request.query.get("name", [None])[0]
            if name is None and isinstance(request.data, dict):
                name = (request.data.get("meta") or {}).get("name")
            if _generation(storage, request.params["bucket_name"], name) != expected:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return
        return insert(request, response, storage, *args, **kwargs)

    objects.download = download_with_generation  # objects.get (alt=media) calls it by name
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is download:
                methods[method] = download_with_generation
            elif handler is insert:
                methods[method] = insert_if_generation_matches
    server.create_server("127.0.0.1", port).run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
