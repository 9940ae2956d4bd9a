"""What a compiled GPU program holds and how fast it can run at best: its kernels read from XLA's
optimized HLO text (``compiled.as_text()``), counted (fusions, copies, transposes, scatters by
dtype, custom calls by target, collectives) and priced one by one against a chip's roofline.

The roofline of a kernel is ``max(dot FLOPs / tensor-core peak + other FLOPs / vector peak,
bytes / HBM bandwidth)``, where its bytes are its operands read once and its outputs written once
(an operand that a fusion only slices counts as the slices it reads: RoPE or a band block reads
its q, k or v out of the fused QKV product, not the whole product);
a collective's time is its bytes over the link it crosses (NVLink inside a node, the network
between nodes). The step's estimate is the sum over the kernels as they run (a loop's body times
its trip count). For the kernels it is a lower bound of the step time: it counts no launch
overhead, no tail effects, and treats every kernel as reaching the chip's peak; collectives are
added as if nothing overlapped them (on one GPU there are none). XLA's GPU compiler gives no cost analysis of its own (``cost_analysis()`` is None), so this
reading of the program is the estimate.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

NOTE = (
    "est_* on a GPU: the optimized program's kernels each at the chip's peak FLOP/s or HBM "
    "bandwidth, summed (a lower bound: no launch overhead), plus its collectives at link bandwidth "
    "as if not overlapped; bertjax.hlo_roofline, not a measurement"
)

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "s2": 0.25, "u2": 0.25, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
# Instructions that launch nothing (views, tuples, bookkeeping) or whose cost is elsewhere.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "iota",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
    "copy-done", "send-done", "recv-done", "reduce-scatter-done", "all-to-all-done",
}  # fmt: skip
# Fused instructions that move or re-index data (no arithmetic).
NO_FLOPS = FREE | {
    "broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "reverse", "gather", "convert",
    "bitcast-convert", "select", "compare",
}  # fmt: skip
COLLECTIVES = {
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Chip:
    """The roofline of one accelerator: dense peaks, HBM bandwidth, links."""

    name: str
    bf16_flops: float  # dense tensor-core FLOP/s, bf16/fp16 inputs
    tf32_flops: float  # dense tensor-core FLOP/s for f32 dots (TF32)
    vector_flops: float  # non-tensor FP32 FLOP/s (elementwise, reductions)
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction (NVLink)
    inter_node_bytes_per_s: float  # per GPU, one direction (network)
    devices_per_node: int = 8


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    index: int | None = None  # a parameter's number

    def attr(self, key: str) -> str | None:
        m = re.search(rf'\b{key}=(?:"([^"]*)"|%?([\w.\-$]+))', self.attrs)
        return (m.group(1) if m.group(1) is not None else m.group(2)) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def backend_config(self) -> dict[str, Any]:
        i = self.attrs.find("backend_config=")
        if i < 0:
            return {}
        text = self.attrs[i + len("backend_config=") :]
        try:
            return json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            return {}


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]
    is_entry: bool = False

    def shapes(self) -> dict[str, str]:
        return {i.name: i.shape for i in self.instructions}

    @property
    def root(self) -> Instruction:
        return self.instructions[-1]


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, close = 0, pairs[text[start]]
    opener = text[start]
    for i in range(start, len(text)):
        if text[i] == opener:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    end = _balanced(rest, paren)
    operands = _NAME.findall(rest[paren:end])
    index = None
    if opcode == "parameter":
        number = rest[paren + 1 : end - 1].strip()
        index = int(number) if number.isdigit() else None
    return Instruction(name, shape, opcode, operands, rest[end:], index)


def parse(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name (the entry one marked)."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
            if head:
                current = Computation(head.group(2), [], bool(head.group(1)))
            continue
        if line.startswith("}"):
            comps[current.name] = current
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            current.instructions.append(inst)
    return comps


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of each array in a shape (a tuple's elements in order)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def nbytes(shape: str, skip: tuple[str, ...] = ()) -> float:
    """The bytes of a shape's arrays (those of the dtypes in ``skip`` left out)."""
    return sum(
        DTYPE_BYTES.get(d, 4) * math.prod(dims) for d, dims in arrays(shape) if d not in skip
    )


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in arrays(shape))


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def _dims_attr(inst: Instruction, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", inst.attrs)
    return _ints(m.group(1)) if m else []


@dataclasses.dataclass
class Cost:
    tensor_flops: float = 0.0  # dots at the bf16 tensor-core rate
    tf32_flops: float = 0.0  # f32 dots
    vector_flops: float = 0.0
    bytes: float = 0.0
    link_seconds: float = 0.0

    def add(self, other: Cost, times: float = 1.0) -> None:
        self.tensor_flops += other.tensor_flops * times
        self.tf32_flops += other.tf32_flops * times
        self.vector_flops += other.vector_flops * times
        self.bytes += other.bytes * times
        self.link_seconds += other.link_seconds * times

    def seconds(self, chip: Chip) -> float:
        compute = (
            self.tensor_flops / chip.bf16_flops
            + self.tf32_flops / chip.tf32_flops
            + self.vector_flops / chip.vector_flops
        )
        return max(compute, self.bytes / chip.hbm_bytes_per_s) + self.link_seconds


class Program:
    """An optimized HLO module: its kernels as they run, their inventory and roofline."""

    def __init__(self, text: str):
        self.comps = parse(text)
        entries = [c for c in self.comps.values() if c.is_entry]
        if not entries:
            raise ValueError("no ENTRY computation in the HLO text")
        self.entry = entries[0]
        header = text[: text.find("\n")]
        partitions = re.search(r"num_partitions=(\d+)", header)
        replicas = re.search(r"replica_count=(\d+)", header)
        self.num_devices = int(partitions.group(1) if partitions else 1) * int(
            replicas.group(1) if replicas else 1
        )
        self._shapes = {name: comp.shapes() for name, comp in self.comps.items()}
        self._sliced: dict[str, dict[int, float]] = {}

    # -- walking the program -------------------------------------------------------------------
    def kernels(self) -> list[tuple[Computation, Instruction, float]]:
        """Each launched instruction with its computation and how many times a step runs it."""
        out: list[tuple[Computation, Instruction, float]] = []

        def walk(comp: Computation, times: float, seen: tuple[str, ...]) -> None:
            for inst in comp.instructions:
                if inst.opcode == "while":
                    body = self.comps.get(inst.attr("body") or "")
                    trips = self._trip_count(inst)
                    if body is not None and body.name not in seen:
                        walk(body, times * trips, (*seen, body.name))
                elif inst.opcode in ("call", "conditional", "async-start"):
                    names = [inst.attr("to_apply"), inst.attr("calls")]
                    names += re.findall(r"%([\w.\-]+)", _branch_text(inst.attrs))
                    for sub in filter(None, names):
                        if sub in self.comps and sub not in seen:
                            walk(self.comps[sub], times, (*seen, sub))
                    if inst.opcode == "async-start":
                        continue
                elif inst.opcode not in FREE:
                    out.append((comp, inst, times))

        walk(self.entry, 1.0, (self.entry.name,))
        return out

    @staticmethod
    def _trip_count(inst: Instruction) -> float:
        trips = inst.backend_config().get("known_trip_count", {}).get("n")
        return float(trips) if trips else 1.0

    def _operand_shapes(self, comp: Computation, inst: Instruction) -> list[str]:
        shapes = self._shapes[comp.name]
        return [shapes[o] for o in inst.operands if o in shapes]

    # -- costs ---------------------------------------------------------------------------------
    def _fused_flops(self, comp_name: str, cost: Cost, depth: int = 0) -> None:
        comp = self.comps.get(comp_name)
        if comp is None or depth > 8:
            return
        shapes = self._shapes[comp_name]
        for inst in comp.instructions:
            sub = inst.attr("calls")
            if inst.opcode == "fusion" and sub:
                self._fused_flops(sub, cost, depth + 1)
            elif inst.opcode == "dot":
                self._dot_flops(inst, shapes, cost)
            elif inst.opcode in ("reduce", "reduce-window"):
                cost.vector_flops += sum(_elements(shapes.get(o, "")) for o in inst.operands[:1])
            elif inst.opcode not in NO_FLOPS and inst.opcode != "fusion":
                cost.vector_flops += _elements(inst.shape)

    @staticmethod
    def _dot_flops(inst: Instruction, shapes: dict[str, str], cost: Cost) -> None:
        lhs = arrays(shapes.get(inst.operands[0], "")) if inst.operands else []
        if not lhs:
            return
        dtype, dims = lhs[0]
        contracting = math.prod(dims[d] for d in _dims_attr(inst, "lhs_contracting_dims"))
        flops = 2.0 * _elements(inst.shape) * contracting
        if dtype in ("f32", "f64"):
            cost.tf32_flops += flops
        else:
            cost.tensor_flops += flops

    def _custom_call_flops(self, comp: Computation, inst: Instruction, cost: Cost) -> None:
        target = inst.attr("custom_call_target") or ""
        config = inst.backend_config()
        shapes = self._operand_shapes(comp, inst)
        if "cublas" in target and len(shapes) >= 2:
            dnums = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            lhs = arrays(shapes[0])[0]
            contracting = math.prod(
                lhs[1][int(d)] for d in dnums.get("lhs_contracting_dimensions", [])
            )
            out = arrays(inst.shape)[0]
            flops = 2.0 * math.prod(out[1]) * contracting
            if lhs[0] in ("f32", "f64"):
                cost.tf32_flops += flops
            else:
                cost.tensor_flops += flops
        elif "fmha" in target and shapes:
            fmha = config.get("cudnn_fmha_backend_config", {})
            scores = [
                int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", [])
            ]
            d_head = arrays(shapes[0])[0][1][-1]  # q is [b, t, n, h] or [b, n, t, h]
            if not scores or not d_head:
                return
            pairs = math.prod(scores)  # [batch, heads, q, k] scores
            window = int(fmha.get("sliding_window_length", 0) or 0)
            if window > 0:
                pairs = pairs * min(1.0, window / scores[-1])
            if fmha.get("mask_type") == "CAUSAL":
                pairs = pairs / 2
            forward = 4.0 * pairs * d_head  # Q K^T and P V
            cost.tensor_flops += forward * (2.5 if "ackward" in target else 1.0)

    def _collective_seconds(self, inst: Instruction, chip: Chip) -> float:
        """Bytes over the link: ring all-reduce ``2 (n-1)/n`` of the buffer, all-gather,
        reduce-scatter and all-to-all ``(n-1)/n`` of the full buffer, a permute all of it. An
        async ``-start`` op's shape holds its operands and its results."""
        base = inst.opcode.removesuffix("-start")
        asynchronous = inst.opcode.endswith("-start")
        total = nbytes(inst.shape)
        groups = self._replica_groups(inst.attrs)
        n = len(groups[0]) if groups else 1
        if base == "collective-permute":
            moved = total / 2 if asynchronous else total
            pairs = [tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", inst.attrs)]
            per_node = chip.devices_per_node
            crosses = any(a // per_node != b // per_node for a, b in pairs)
        else:
            if n <= 1:
                return 0.0
            if base == "all-reduce":
                moved = 2.0 * (n - 1) / n * total
            elif base == "all-gather":  # async: input + n x input
                moved = (n - 1) / n * (total * n / (n + 1) if asynchronous else total)
            elif base == "reduce-scatter":  # the input is n x the output
                moved = (n - 1) / n * (total * n / (n + 1) if asynchronous else total * n)
            else:  # all-to-all and others: input and output the same size
                moved = (n - 1) / n * (total / 2 if asynchronous else total)
            crosses = any(len({d // chip.devices_per_node for d in g}) > 1 for g in groups)
        link = chip.inter_node_bytes_per_s if crosses else chip.intra_node_bytes_per_s
        return moved / link

    def _replica_groups(self, attrs: str) -> list[list[int]]:
        """The device groups of a collective, from any of XLA's spellings: explicit lists, iota
        (``[2,4]<=[8]T(1,0)``), mesh axes (``mesh['a'=2,'b'=4] {'b'}``) or ``{}`` (all)."""
        m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
        if m:
            axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
            names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
            chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2)) if a in names]
            ids = np.arange(math.prod(sizes)).reshape(sizes)
            rest = [i for i in range(len(sizes)) if i not in chosen]
            size = math.prod(sizes[i] for i in chosen)
            return ids.transpose(rest + chosen).reshape(-1, size).tolist()
        m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
        if m:
            shape, dims = _ints(m.group(1)), _ints(m.group(2))
            ids = np.arange(math.prod(dims)).reshape(dims)
            if m.group(3):
                ids = ids.transpose(_ints(m.group(3)))
            return ids.reshape(shape[0], -1).tolist()
        m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
        if m:
            groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1)) if g]
            return groups or [list(range(self.num_devices))]
        return [list(range(self.num_devices))] if "replica_groups" not in attrs else []

    def kernel_cost(self, comp: Computation, inst: Instruction, chip: Chip) -> Cost:
        cost = Cost()
        base = inst.opcode.removesuffix("-start")
        if base in COLLECTIVES:
            cost.link_seconds = self._collective_seconds(inst, chip)
            return cost
        operands = self._operand_shapes(comp, inst)
        workspace = ("u8", "s8") if inst.opcode == "custom-call" else ()  # a custom call's scratch
        read = [nbytes(s) for s in operands]
        if inst.opcode == "fusion":
            sliced = self._sliced_parameters(inst.attr("calls") or "")
            read = [min(b, sliced.get(i, b)) for i, b in enumerate(read)]
        cost.bytes = sum(read) + nbytes(inst.shape, skip=workspace)
        update = self._in_place_update(inst) if inst.opcode == "fusion" else None
        if update is not None:  # the buffer is updated in place: only the slice is written
            cost.bytes -= 2 * nbytes(inst.shape) - nbytes(update)
        if inst.opcode == "fusion":
            self._fused_flops(inst.attr("calls") or "", cost)
        elif inst.opcode == "custom-call":
            self._custom_call_flops(comp, inst, cost)
        elif inst.opcode == "dot":
            self._dot_flops(inst, self._shapes[comp.name], cost)
        elif inst.opcode not in NO_FLOPS:
            cost.vector_flops += _elements(inst.shape)
        return cost

    # -- reports -------------------------------------------------------------------------------
    def roofline(self, chip: Chip, top: int = 12) -> dict[str, Any]:
        """The step's roofline estimate: seconds, the compute/memory/link split, the costliest
        kernels."""
        total, rows = Cost(), []
        seconds = 0.0
        for comp, inst, times in self.kernels():
            cost = self.kernel_cost(comp, inst, chip)
            t = cost.seconds(chip) * times
            seconds += t
            total.add(cost, times)
            rows.append((t, inst, times))
        rows.sort(key=lambda r: -r[0])
        return {
            "est_step_seconds": seconds,
            "dot_flops": total.tensor_flops + total.tf32_flops,
            "other_flops": total.vector_flops,
            "hbm_bytes": total.bytes,
            "link_seconds": total.link_seconds,
            "top_kernels": [
                {
                    "name": inst.name,
                    "est_us": round(t * 1e6, 1),
                    "runs": int(times),
                    "shape": inst.shape[:120],
                    "op": inst.op_name[-120:],
                }
                for t, inst, times in rows[:top]
            ],
        }

    def inventory(self) -> dict[str, Any]:
        """Counts of the program's kernels: fusions, copies, transposes, scatters by dtype,
        custom calls and GEMM kernels by target, collectives; the largest kernel outputs."""
        kernels = self.kernels()
        counts: dict[str, Any] = collections.Counter()
        custom: collections.Counter = collections.Counter()
        collectives: collections.Counter = collections.Counter()
        scatters: collections.Counter = collections.Counter()
        scatter_shapes: list[str] = []
        outputs: list[tuple[float, str, str]] = []
        for _comp, inst, _ in kernels:
            outputs.append((nbytes(inst.shape), inst.shape, inst.op_name))
            base = inst.opcode.removesuffix("-start")
            if base in COLLECTIVES:
                collectives[base] += 1
            elif inst.opcode == "fusion":
                counts["fusions"] += 1
                kind = inst.backend_config().get("fusion_backend_config", {}).get("kind", "")
                if "gemm" in kind or "triton" in kind:
                    custom["triton_gemm"] += 1
                elif "cudnn" in kind:
                    custom[kind] += 1
                root = self._fused_root(inst.attr("calls") or "")
                if root == "transpose":
                    counts["transposes"] += 1
                elif root == "copy":
                    counts["copies"] += 1
                self._scatters(inst.attr("calls") or "", scatters, scatter_shapes)
            elif inst.opcode in ("copy", "copy-start"):
                counts["copies"] += 1
            elif inst.opcode == "transpose":
                counts["transposes"] += 1
            elif inst.opcode == "scatter":
                _record_scatter(inst, scatters, scatter_shapes)
            elif inst.opcode == "custom-call":
                custom[inst.attr("custom_call_target") or ""] += 1
        outputs.sort(key=lambda r: -r[0])
        return {
            "kernels": len(kernels),
            "fusions": counts["fusions"],
            "copies": counts["copies"],
            "transposes": counts["transposes"],
            "scatters": dict(scatters),
            "scatter_shapes": sorted(set(scatter_shapes)),
            "custom_calls": dict(custom),
            "collectives": dict(collectives),
            "largest_outputs": [
                {"bytes": int(b), "shape": s.split("{")[0][:120], "op": op[-100:]}
                for b, s, op in outputs[:5]
            ],
        }

    def _in_place_update(self, inst: Instruction) -> str | None:
        """The update's shape when fusion ``inst`` is a dynamic-update-slice of one of its
        operands (the output aliases that operand: XLA writes the slice in place, as a scan's
        stacked outputs are), else None."""
        comp = self.comps.get(inst.attr("calls") or "")
        if comp is None:
            return None
        by_name = {i.name: i for i in comp.instructions}
        root = comp.root
        while root.opcode == "bitcast" and root.operands and root.operands[0] in by_name:
            root = by_name[root.operands[0]]
        if root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
            return None
        buffer, update = (by_name.get(o) for o in root.operands[:2])
        if buffer is None or update is None or buffer.opcode != "parameter":
            return None
        if nbytes(buffer.shape) != nbytes(inst.shape):
            return None
        return update.shape

    def _sliced_parameters(self, name: str) -> dict[int, float]:
        """Fused computation ``name``'s parameters that it only slices (every use, through
        bitcasts, a ``slice`` or ``dynamic-slice``): their index -> the bytes of those slices.
        A kernel reads only those bytes of such an operand."""
        if name in self._sliced:
            return self._sliced[name]
        comp = self.comps.get(name)
        out: dict[int, float] = {}
        if comp is not None:
            users: dict[str, list[Instruction]] = collections.defaultdict(list)
            for inst in comp.instructions:
                for operand in inst.operands:
                    users[operand].append(inst)

            def slices(node: str, depth: int = 0) -> float | None:
                total = 0.0
                for user in users.get(node, []):
                    if user.opcode == "bitcast" and depth < 4:
                        part = slices(user.name, depth + 1)
                        if part is None:
                            return None
                        total += part
                    elif user.opcode == "slice" or (
                        user.opcode == "dynamic-slice" and user.operands[0] == node
                    ):
                        total += nbytes(user.shape)
                    else:
                        return None
                return total if users.get(node) else None

            for inst in comp.instructions:
                if inst.opcode == "parameter" and inst.index is not None:
                    part = slices(inst.name)
                    if part is not None:
                        out[inst.index] = part
        self._sliced[name] = out
        return out

    def _fused_root(self, name: str) -> str:
        comp = self.comps.get(name)
        if comp is None:
            return ""
        root = comp.root
        by_name = {i.name: i for i in comp.instructions}
        while root.opcode == "bitcast" and root.operands and root.operands[0] in by_name:
            root = by_name[root.operands[0]]
        return root.opcode

    def _scatters(self, name, counter, shapes, depth=0) -> None:
        """The scatters inside fused computation ``name`` (and the fusions it nests)."""
        comp = self.comps.get(name)
        if comp is None or depth > 8:
            return
        for inst in comp.instructions:
            if inst.opcode == "scatter":
                _record_scatter(inst, counter, shapes)
            elif inst.opcode == "fusion":
                self._scatters(inst.attr("calls") or "", counter, shapes, depth + 1)


def _record_scatter(inst: Instruction, counter: collections.Counter, shapes: list[str]) -> None:
    counter[arrays(inst.shape)[0][0]] += 1
    shapes.append(inst.shape.split("{")[0])


def _branch_text(attrs: str) -> str:
    m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    return m.group(1) if m else ""
