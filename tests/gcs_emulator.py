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
honoured as GCS does. Two hooks for the fault tests: ``$GCS_EMULATOR_DIE_ON`` (a substring of
object names) makes the process die, without a reply, when an upload of such an object arrives
(before storing it: a fault in the middle of a write), and every object deleted is appended to
``deletions.log`` beside the data (the order in which a client removed things)."""

from __future__ import annotations

import json
import os
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

    def start(self, timeout_s: float = 30.0, die_on: str | None = None) -> None:
        """Starts the emulator (again, on the same port and data after ``stop``); ``die_on``: it
        dies at the first upload of an object whose name holds that string."""
        os.makedirs(self.data_dir, exist_ok=True)
        self._log = open(os.path.join(self.data_dir, "..", "emulator.log"), "ab")  # noqa: SIM115
        env = {**os.environ, "STORAGE_BASE": self.data_dir, "STORAGE_DIR": "store"}
        env.pop("GCS_EMULATOR_DIE_ON", None)
        if die_on:
            env["GCS_EMULATOR_DIE_ON"] = die_on
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

    def kill_during_upload(self, name_part: str, down_s: float = 1.0) -> threading.Thread:
        """Restarts the emulator so that it dies at the first upload of an object whose name
        holds ``name_part``, then, ``down_s`` seconds after it died, starts it again (same port,
        same data, no fault). Returns the watching thread (join it: it ends once restarted)."""
        self.stop()
        self.start(die_on=name_part)
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


def serve(port: int) -> None:
    """The emulator on 127.0.0.1:PORT (objects under $STORAGE_BASE/$STORAGE_DIR), patched as the
    module docstring says."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download, insert, delete = objects.download, objects.insert, objects._delete
    die_on = os.environ.get("GCS_EMULATOR_DIE_ON")
    deletions = os.path.join(os.environ["STORAGE_BASE"], "..", "deletions.log")

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
        if die_on:
            name = request.query.get("name", [None])[0]
            if name is None and isinstance(request.data, dict):
                name = (request.data.get("meta") or {}).get("name")
            if name and die_on in name:
                os._exit(1)  # a fault in the middle of a write: no reply, nothing stored
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
    objects._delete = delete_and_record  # objects.delete and batch deletes call it by name
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is download:
                methods[method] = download_with_generation
            elif handler is insert:
                methods[method] = insert_if_generation_matches
    server.create_server("127.0.0.1", port).run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
