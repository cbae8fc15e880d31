"""What the toolchain says about a compiled candidate, read without a GPU.

From a cubin: per kernel, the resource usage ``cuobjdump --dump-resource-usage`` prints (registers,
static shared memory, local memory, stack) and the SASS instruction mix (``cuobjdump -sass``),
counted per pipe class. Two mixes per kernel: ``static`` (every instruction of the function) and
``loops``: per loop (a body closed by a backward branch), the instructions along its shortest path,
which is one iteration over ordinary data, with its memory instructions split by kind (global
load/store, shared load/store) and the bytes per thread its global accesses move, because the
model charges them to different resources and reads the bytes in flight from them.

Pipe classes follow Nsight Compute's pipes on sm_90/sm_100: ``alu`` (integer/logic, compares,
selects, float min/max, PRMT), ``imad`` (IMAD/IMUL: integer work issued on the FMA-heavy pipe),
``fma`` (FP32 and packed FP16/BF16 arithmetic), ``conversion`` (F2F/F2I/I2F/F2FP...: the SM100
hardware FP4 ``cvt.rn.satfinite.e2m1x2.f32`` shows up here as ``F2FP`` with an E2M1 suffix),
``mufu``, ``memory``, ``uniform`` (the U* datapath), ``control``.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

CLASSES: dict[str, tuple[str, ...]] = {
    "alu": ("IADD3", "LOP3", "SHF", "SHL", "SHR", "ISETP", "SEL", "PRMT", "IMNMX", "VIMNMX", "FSETP", "FSEL",
            "FMNMX", "LEA", "IABS", "FLO", "POPC", "BMSK", "SGXT", "PLOP3", "P2R", "R2P", "MOV", "VIADD",
            "IADD", "BREV", "HSETP2", "HMNMX2", "VIMNMX3", "IADD3X"),
    "imad": ("IMAD", "IMUL"),
    "fma": ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "FSWZADD", "FMUL2", "FFMA2", "FADD2"),
    "conversion": ("F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND", "F2IP"),
    "mufu": ("MUFU",),
    "memory": ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "LDC", "ATOM", "ATOMS", "RED", "LDSM",
               "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG"),
    "control": ("BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "NOP", "BAR", "S2R", "CS2R", "S2UR", "WARPSYNC",
                "DEPBAR", "YIELD", "ACQBULK", "ELECT", "ENDCOLLECTIVE"),
}
PIPES = (*CLASSES, "uniform", "other")
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}
# Memory instructions by the resource they use (the model charges global and shared separately).
MEMORY_KINDS = {"global_load": ("LDG", "LD"), "global_store": ("STG", "ST", "RED", "ATOM"),
                "shared_load": ("LDS", "LDSM"), "shared_store": ("STS",), "local": ("LDL", "STL")}

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def pipe_class(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base.startswith("U") and base not in _CLASS_OF:
        return "uniform"
    return _CLASS_OF.get(base, "other")


def memory_kind(opcode: str) -> str | None:
    base = opcode.split(".")[0]
    return next((kind for kind, ops in MEMORY_KINDS.items() if base in ops), None)


def access_bytes(opcode: str) -> int:
    """Bytes per thread of a load/store: ``LDG.E.128`` 16, ``.64`` 8, ``.U8``/``.S8`` 1, ``.U16`` 2, else 4."""
    parts = opcode.split(".")
    for suffix, size in (("128", 16), ("64", 8), ("U8", 1), ("S8", 1), ("U16", 2), ("S16", 2)):
        if suffix in parts:
            return size
    return 4


def hardware_fp4(opcode: str) -> bool:
    """The SM100-family E2M1 conversion (``cvt.rn.satfinite.e2m1x2.f32`` -> ``F2FP...E2M1...``)."""
    return opcode.startswith("F2FP") and "E2M1" in opcode


Insn = tuple[int, str, str, bool]   # address, opcode, operands, predicated


def parse_sass(sass: str) -> dict[str, list[Insn]]:
    """Function name -> its instructions, from ``cuobjdump -sass`` output."""
    functions: dict[str, list[Insn]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = line.split("Function :", 1)[1].strip()
            functions[current] = []
        elif current is not None and (m := _INSN.search(line)):
            functions[current].append((int(m.group(1), 16), m.group(3), m.group(4), bool(m.group(2))))
    return functions


def parse_resources(text: str) -> dict[str, dict[str, int]]:
    """Function name -> registers, stack, static shared and local bytes (``--dump-resource-usage``)."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        if line.strip().startswith("Function ") and line.rstrip().endswith(":"):
            name = line.strip()[len("Function "):-1]
        elif name and (m := _RESOURCE.search(line)):
            regs, stack, shared, local = map(int, m.groups())
            out[name] = {"registers": regs, "stack_bytes": stack, "shared_bytes": shared, "local_bytes": local}
            name = None
    return out


def loop_bodies(insns: Sequence[Insn]) -> list[list[Insn]]:
    """Bodies of the loops: a backward BRA closes [target, branch]."""
    bodies = []
    for addr, op, args, _ in insns:
        if op.startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", args)) and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            bodies.append([i for i in insns if start <= i[0] <= addr])
    return bodies


def shortest_path(body: Sequence[Insn]) -> list[Insn]:
    """The instructions on the shortest way from a loop's head to its backward branch: what an
    iteration of ordinary data executes (slow paths for special values skipped). The body's forward
    branches make it a DAG, so dynamic programming from the end."""
    index = {insn[0]: i for i, insn in enumerate(body)}
    best: list[list[Insn] | None] = [None] * len(body)
    best[-1] = [body[-1]]
    for i in range(len(body) - 2, -1, -1):
        addr, op, args, predicated = body[i]
        nexts = []
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) in index and int(target.group(1), 16) > addr:
            nexts.append(index[int(target.group(1), 16)])
        if not op.startswith("BRA") or predicated or not target:
            nexts.append(i + 1)   # falls through: not an unconditional branch
        options = [best[j] for j in nexts if best[j] is not None]
        best[i] = [body[i], *min(options, key=len)] if options else None
    return best[0] or list(body)


@dataclass(frozen=True)
class Mix:
    """Instruction counts of a stretch of SASS: per pipe class and per memory kind."""

    total: int
    per_pipe: dict[str, int]
    memory: dict[str, int]
    global_bytes: int          # bytes per thread its global loads and stores move
    load_bytes: int            # of which loaded (what a thread waits for)
    hardware_fp4: int
    shared_load_bytes: int     # bytes per thread its shared-memory loads read (model 2's shared pipe)

    @classmethod
    def of(cls, insns: Sequence[Insn]) -> "Mix":
        pipes = Counter(pipe_class(i[1]) for i in insns)
        kinds = Counter(k for i in insns if (k := memory_kind(i[1])))
        loaded = sum(access_bytes(i[1]) for i in insns if memory_kind(i[1]) == "global_load")
        stored = sum(access_bytes(i[1]) for i in insns if memory_kind(i[1]) == "global_store")
        shared = sum(access_bytes(i[1]) for i in insns if memory_kind(i[1]) == "shared_load")
        return cls(len(insns), {p: pipes.get(p, 0) for p in PIPES}, {k: kinds.get(k, 0) for k in MEMORY_KINDS},
                   loaded + stored, loaded, sum(hardware_fp4(i[1]) for i in insns), shared)


@dataclass(frozen=True)
class KernelFeatures:
    name: str
    registers: int
    shared_bytes: int          # static, with the driver's 1 KiB per CTA; dynamic shared memory is the launch's
    local_bytes: int
    stack_bytes: int
    static: Mix
    loops: list[Mix]           # per loop (backward branch), its shortest path: one ordinary iteration


def loop_mix(body: Sequence[Insn]) -> Mix:
    """One ordinary iteration of a loop: the arithmetic of its shortest path, the memory accesses of
    its whole body (a guarded access, ``if (p) v = *p``, is a branch around the load that the
    shortest path would skip; it is the data the loop exists to move)."""
    path, whole = Mix.of(shortest_path(body)), Mix.of(body)
    per_pipe = {**path.per_pipe, "memory": whole.per_pipe["memory"]}
    total = path.total - path.per_pipe["memory"] + whole.per_pipe["memory"]
    return Mix(total, per_pipe, whole.memory, whole.global_bytes, whole.load_bytes, path.hardware_fp4,
               whole.shared_load_bytes)


def kernel_features(name: str, insns: Sequence[Insn], resources: dict[str, int]) -> KernelFeatures:
    loops = [loop_mix(body) for body in loop_bodies(insns)]
    return KernelFeatures(name, resources["registers"], resources["shared_bytes"], resources["local_bytes"],
                          resources["stack_bytes"], Mix.of(insns), loops)


def cuobjdump() -> Path:
    """The cuobjdump Triton's wheel ships (it reads every target's cubin)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def cubin_features(cubin: Path, tool: Path | None = None) -> dict[str, KernelFeatures]:
    """Every kernel of a cubin: resources and instruction mix."""
    tool = tool or cuobjdump()
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    resources = parse_resources(usage)
    return {name: kernel_features(name, insns, resources[name]) for name, insns in parse_sass(sass).items()
            if name in resources}


def embedded_cubin(obj: Path, out: Path) -> Path:
    """The device ELF a host object or shared library embeds as data (a CuTe DSL export's ``.o`` or
    the score ``.so`` carries the cubin that way, not as a fatbin section cuobjdump would find): the
    first ELF image after the host's own whose machine is EM_CUDA, cut out by its own section and
    program header tables."""
    data = Path(obj).read_bytes()
    start = data.find(b"\x7fELF", 1)
    while start >= 0 and int.from_bytes(data[start + 18:start + 20], "little") != 190:   # EM_CUDA
        start = data.find(b"\x7fELF", start + 1)
    if start < 0:
        raise ValueError(f"{obj}: no embedded cubin")
    phoff, shoff = struct.unpack_from("<QQ", data, start + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, start + 0x36)
    out.write_bytes(data[start:start + max(shoff + shentsize * shnum, phoff + phentsize * phnum)])
    return out


def nvcc_cubin(source: Path, arch: str, includes: Sequence[Path], out: Path, nvcc: str = "nvcc") -> Path:
    """``source`` compiled for ``arch`` to a cubin only, with the build's code-generation flags
    (``-O3 --fmad=false``, kvgen.build.nvcc); no host code, no link."""
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", "--fmad=false", "-gencode", f"arch=compute_{arch[3:]},code={arch}",
           *(f"-I{d}" for d in includes), "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc -cubin failed for {source} ({arch}):\n{proc.stderr[-2000:]}")
    return out


def to_json(features: dict[str, KernelFeatures]) -> dict:
    return {name: asdict(f) for name, f in features.items()}


def from_json(data: dict) -> dict[str, KernelFeatures]:
    def mix(d: dict) -> Mix:
        return Mix(d["total"], d["per_pipe"], d["memory"], d["global_bytes"], d["load_bytes"], d["hardware_fp4"],
                   d["shared_load_bytes"])

    return {name: KernelFeatures(**{**f, "static": mix(f["static"]), "loops": [mix(m) for m in f["loops"]]})
            for name, f in data.items()}


def extract(sources: Sequence[dict], arch: str, includes: Sequence[Path], cache: Path, cubins: Path,
            nvcc: str = "nvcc", log=print) -> dict[str, dict]:
    """Features of every ``{"key", "source"}`` entry compiled for ``arch``, cached in the JSON file
    ``cache`` under ``key``; the cubins are kept in ``cubins/`` by key digest, so a change to the
    feature extraction re-reads them without compiling again."""
    done = json.loads(Path(cache).read_text()) if Path(cache).is_file() else {}
    cubins.mkdir(parents=True, exist_ok=True)
    for i, entry in enumerate(sources):
        if entry["key"] in done:
            continue
        cubin = cubins / (hashlib.sha256(entry["key"].encode()).hexdigest()[:20] + ".cubin")
        if not cubin.is_file():
            nvcc_cubin(Path(entry["source"]), arch, includes, cubin.with_suffix(".tmp"), nvcc).rename(cubin)
        done[entry["key"]] = to_json(cubin_features(cubin))
        log(f"[{i + 1}/{len(sources)}] {entry['key']}")
        Path(cache).write_text(json.dumps(done, indent=0, sort_keys=True) + "\n")
    return done
