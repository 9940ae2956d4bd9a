"""Fine-tuning data from TFDS (an empty ``data_dir``) fails fast without a network: when the
dataset is not prepared in the TFDS data dir and its download host does not answer within a few
seconds, one line says so and names the local files ``--config.data_dir`` should hold, instead of
TFDS retrying its download for minutes."""

from __future__ import annotations

import socket
import threading

_TIMEOUT_S = 5.0
# Where TFDS downloads each dataset from (tensorflow_datasets' builders).
_HOSTS = {"glue": "dl.fbaipublicfiles.com", "squad": "rajpurkar.github.io"}
_HOSTS["conll2003"] = "data.deepai.org"


def network_reachable(host: str, timeout: float = _TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host``:443 opens within ``timeout`` seconds (name lookup
    included: it runs in a thread, since a lookup with no network can block far longer)."""
    ok = []

    def connect():
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def require_prepared_or_online(builder, local_files: str) -> None:
    """Raises a one-line ValueError when ``builder`` (a ``tfds.builder``) would have to download
    and its host is unreachable; ``local_files`` names the files to pass instead."""
    if builder.is_prepared() or _download_is_mocked(builder):
        return
    name = builder.name
    host = _HOSTS.get(name, "storage.googleapis.com")
    if network_reachable(host):
        return
    raise ValueError(
        f"tfds:{builder.info.full_name}: not prepared in the TFDS data dir ({builder.data_dir}) "
        f"and {host} is unreachable (no network?); pass local files with "
        f"--config.data_dir=DIR holding {local_files}, or prepare the TFDS data on a machine "
        "with a network and copy its data dir (TFDS_DATA_DIR)"
    )


def _download_is_mocked(builder) -> bool:
    """Whether ``tfds.testing.mock_data`` replaced the download (nothing would be fetched)."""
    prepare = getattr(type(builder), "download_and_prepare", None)
    return getattr(prepare, "__module__", "").startswith("tensorflow_datasets.testing")
