"""Multi-process probe for bertjax.distributed, run by tests through launch/local.sh.

Each process initializes through `bertjax.distributed.initialize_from_flags`, builds one global
array over every device of every process with `jax.make_array_from_process_local_data`, sums it
with a jitted reduction, exercises the host helpers, and prints one ``PROBE_RESULT {json}`` line.

    BERTJAX_CMD="python tests/multihost_probe.py" launch/local.sh 2 --devices_per_process 2 --
"""

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bertjax import distributed  # noqa: E402

distributed.define_flags()
_SLEEP_S = flags.DEFINE_float("sleep_s", 0.0, "Seconds to stay alive after printing the result.")
_ROWS_PER_DEVICE = 3
_COLS = 2


def local_rows(process_index: int, local_device_count: int) -> np.ndarray:
    """This process's slice of the global [devices * rows, cols] array; values depend on process."""
    n = local_device_count * _ROWS_PER_DEVICE * _COLS
    values = np.arange(n, dtype=np.float32) + 1000.0 * process_index
    return values.reshape(local_device_count * _ROWS_PER_DEVICE, _COLS)


def expected_total(process_count: int, local_device_count: int) -> float:
    """The sum every process must see, computed on the host without any communication."""
    return float(sum(local_rows(p, local_device_count).sum() for p in range(process_count)))


def main(argv):
    del argv
    try:
        mode = distributed.initialize_from_flags()
    except distributed.DistributedStartupError as e:
        sys.exit(f"multihost_probe: error: {e}")
    info = distributed.process_info()
    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    rows_bd = local_rows(jax.process_index(), jax.local_device_count())  # [local rows, cols]
    global_bd = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rows_bd)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(global_bd)
    shared = distributed.broadcast_from_coordinator({"seed": 1234 + 7 * jax.process_index()})
    distributed.assert_same_across_hosts({"config": "identical", "lr": 1e-4}, "probe config")
    try:
        distributed.assert_same_across_hosts(jax.process_index(), "process index")
        disagreement = None
    except ValueError as e:
        disagreement = str(e)
    distributed.sync("multihost_probe")
    result = {
        "mode": mode,
        "is_coordinator": distributed.is_coordinator(),
        "info": info,
        "global_shape": list(global_bd.shape),
        "total": float(total),
        "expected_total": expected_total(jax.process_count(), jax.local_device_count()),
        "broadcast": shared,
        "disagreement": disagreement,
    }
    print("PROBE_RESULT " + json.dumps(result, sort_keys=True), flush=True)
    time.sleep(_SLEEP_S.value)


if __name__ == "__main__":
    app.run(main)
