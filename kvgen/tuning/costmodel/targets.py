"""Per-target limits and rates the cost model divides by: one table per arch.

Every value names its source in ``SOURCES`` (listed in docs/tuning.md, "Static cost model"). Where
no vendor document gives a number (SM counts and clocks of parts NVIDIA describes per GPU only,
Rubin's microarchitecture), the value is marked ``estimate`` in ``ESTIMATES`` and says what it was
taken from; the model's picks for that target inherit that uncertainty and the tuned file says so.

Rates are warp instructions per SM per clock (lanes per SM per clock / 32), from the CUDA C++
Programming Guide's arithmetic-instruction throughput table for the compute capability.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Target:
    arch: str
    gpu: str
    sms: int
    clock_ghz: float                 # sustained boost clock
    hbm_gbs: float                   # HBM bandwidth, GB/s (vendor peak)
    hbm_efficiency: float            # share of peak a streaming copy reaches
    host_link_gbs: float             # host link, GB/s per direction (vendor peak)
    l2_mib: float
    registers_per_sm: int
    register_granule: int            # registers are allocated per warp in units of this many per thread
    max_registers_per_thread: int
    shared_per_sm: int               # bytes usable by CTAs on one SM
    warps_per_sm: int
    ctas_per_sm: int
    # warp instructions per SM per clock, per pipe class (kvgen.tuning.costmodel.features.PIPES)
    issue: dict[str, float]
    shared_bytes_per_clk: int        # shared-memory bandwidth per SM (32 banks x 4 bytes): one L1 wavefront
    l1_wavefronts_per_clk: float     # L1 data-pipe wavefronts per SM per clock (model 3)
    dram_latency_ns: float           # load-to-use latency of an HBM access
    l2_latency_ns: float             # load-to-use latency of an L2 hit
    warp_inflight_bytes: float       # bytes one warp of a scattered row copy keeps in flight (model 2's walk)
    dependent_issue_cycles: float    # cycles between a warp's consecutive instructions (dependency chains)
    host_latency_ns: float           # round trip of a load from mapped pinned host memory
    launch_us: float                 # launch to first CTA, back to back in one stream

    def asdict(self) -> dict:
        return asdict(self)


# Per-SM issue rates of compute capability 9.0 and 10.x (the Programming Guide's table gives the
# same lanes per SM for the classes below on both): FP32 128 lanes, INT32 add/logic 64, IMAD on
# the FMA-heavy half 64, conversions 16, MUFU 16, one memory instruction per clock into the MIO
# queue, 4 schedulers issuing one warp instruction each per clock ("total").
_ISSUE_SM90_SM100 = {"fma": 4.0, "alu": 2.0, "imad": 2.0, "conversion": 0.5, "mufu": 0.5, "memory": 1.0,
                     "uniform": 1.0, "control": 1.0, "other": 1.0, "total": 4.0}

TARGETS: dict[str, Target] = {
    "sm_90a": Target(
        arch="sm_90a", gpu="NVIDIA H200 SXM", sms=132, clock_ghz=1.98, hbm_gbs=4800, hbm_efficiency=0.85,
        host_link_gbs=64, l2_mib=50, registers_per_sm=65536, register_granule=8, max_registers_per_thread=255,
        shared_per_sm=228 * 1024, warps_per_sm=64, ctas_per_sm=32, issue=_ISSUE_SM90_SM100, shared_bytes_per_clk=128,
        l1_wavefronts_per_clk=1.0,
        dram_latency_ns=650, l2_latency_ns=200, warp_inflight_bytes=2600,
        dependent_issue_cycles=2.0, host_latency_ns=1500, launch_us=2.5),
    "sm_100a": Target(
        arch="sm_100a", gpu="NVIDIA B200", sms=148, clock_ghz=1.965, hbm_gbs=8000, hbm_efficiency=0.85,
        host_link_gbs=64, l2_mib=126, registers_per_sm=65536, register_granule=8, max_registers_per_thread=255,
        shared_per_sm=228 * 1024, warps_per_sm=64, ctas_per_sm=32, issue=_ISSUE_SM90_SM100, shared_bytes_per_clk=128,
        l1_wavefronts_per_clk=1.0,
        dram_latency_ns=700, l2_latency_ns=200, warp_inflight_bytes=2600,
        dependent_issue_cycles=2.0, host_latency_ns=1500, launch_us=2.5),
    "sm_103a": Target(
        arch="sm_103a", gpu="NVIDIA B300 (Blackwell Ultra)", sms=148, clock_ghz=1.965, hbm_gbs=8000,
        hbm_efficiency=0.85, host_link_gbs=128, l2_mib=126, registers_per_sm=65536, register_granule=8,
        max_registers_per_thread=255, shared_per_sm=228 * 1024, warps_per_sm=64, ctas_per_sm=32,
        issue=_ISSUE_SM90_SM100, shared_bytes_per_clk=128,
        l1_wavefronts_per_clk=1.0, dram_latency_ns=700, l2_latency_ns=200, warp_inflight_bytes=2600,
        dependent_issue_cycles=2.0, host_latency_ns=1500, launch_us=2.5),
    "sm_107a": Target(
        arch="sm_107a", gpu="NVIDIA Rubin", sms=224, clock_ghz=1.9, hbm_gbs=22000, hbm_efficiency=0.85,
        host_link_gbs=128, l2_mib=126, registers_per_sm=65536, register_granule=8, max_registers_per_thread=255,
        shared_per_sm=228 * 1024, warps_per_sm=64, ctas_per_sm=32, issue=_ISSUE_SM90_SM100, shared_bytes_per_clk=128,
        l1_wavefronts_per_clk=1.0,
        dram_latency_ns=700, l2_latency_ns=200, warp_inflight_bytes=2600,
        dependent_issue_cycles=2.0, host_latency_ns=1500, launch_us=2.5),
}

# Other parts of an arch that measurements ran on, by a short name (``validate --gpu``): the arch's
# table with what differs. The H100 SXM5 has the H200's SMs, clock, L2 and host link; its HBM3
# moves 3.35 TB/s, not 4.8. A model is validated against the part that measured, not the arch's.
GPUS: dict[str, Target] = {
    "h100": replace(TARGETS["sm_90a"], gpu="NVIDIA H100 SXM5 80GB HBM3", hbm_gbs=3350),
}

SOURCES: dict[str, str] = {
    "cuda-guide": "CUDA C++ Programming Guide 13.0, 'Compute Capabilities' (registers, shared memory, warps "
                  "and CTAs per SM for 9.0 and 10.x) and 'Arithmetic Instructions' (throughput per SM per clock)",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet (HBM3e 4.8 TB/s, PCIe Gen5 x16 128 GB/s both directions); "
            "NVIDIA H100 Tensor Core GPU Architecture white paper (132 SMs on SXM5, 50 MB L2, 1.98 GHz boost)",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB HBM3 at 3.35 TB/s, PCIe Gen5 128 GB/s both "
            "directions); NVIDIA H100 Tensor Core GPU Architecture white paper (SXM5: 132 SMs, 50 MB L2, 1.98 GHz "
            "boost; compute capability 9.0, the per-SM limits of cuda-guide)",
    "b200": "NVIDIA DGX B200 datasheet (8 TB/s HBM3e per GPU); NVIDIA Blackwell Architecture Technical Brief",
    "b300": "NVIDIA Blackwell Ultra (B300) technical blog 'Inside NVIDIA Blackwell Ultra' (8 TB/s HBM3e, "
            "PCIe Gen6 x16, 160 SMs in the full design)",
    "rubin": "NVIDIA Vera Rubin NVL72 announcement, CES 2026 (Rubin GPU: HBM4, 22 TB/s)",
    "latency": "Luo et al., 'Benchmarking and Dissecting the Nvidia Hopper GPU Architecture' (IPDPS 2024): "
               "global-memory load latency of H100 in the 500-700 ns range",
    "calibrated": "kvgen's own H200 measurements (results/2026-11-30-h200-tuned/tuning/): launch gap and "
                  "streaming efficiency of the codec's 1 GiB bucket",
    "calibrated-walk": "kvgen's own H200 measurements, compaction b1 (in-sample: 4 B/ns per warp x 650 ns, "
                       "picked from 3, 4, 5 and 8 B/ns on the same studies the validation judges; b1 meets both "
                       "goals at every value tried, with L2 latencies of 100-400 ns: "
                       "docs/tuning-evidence/costmodel-walk-sensitivity.md)",
    "l1-pipe": "Nsight Compute on the H200, thread-form scorer (docs/tuning-evidence/scorer-warp-form-postmortem.md): "
               "l1tex__data_pipe_lsu_wavefronts 90.9 % busy = 21.4 wavefronts/token at 23.6 clk/token, i.e. one "
               "wavefront per SM per clock; 2.0 wavefronts per broadcast LDS.128",
    "l2": "estimate: ~200 ns for an L2 hit (a few hundred cycles, well below the HBM latency, as Luo et al. "
          "IPDPS 2024 measure on H100); not measured here",
}

ESTIMATES: dict[str, dict[str, str]] = {
    "sm_90a": {"hbm_efficiency": "calibrated", "l1_wavefronts_per_clk": "l1-pipe", "launch_us": "calibrated",
               "dram_latency_ns": "latency",
               "l2_latency_ns": "l2", "warp_inflight_bytes": "calibrated-walk",
               "host_latency_ns": "estimate: PCIe Gen5 round trip, not measured here"},
    # the H100: what was calibrated or measured on the H200 is taken over as it is (not refitted on the
    # H100's own measurements); the HBM latency is Luo et al.'s H100 measurement, as for sm_90a
    "h100": {"hbm_efficiency": "estimate: the H200 calibration", "launch_us": "estimate: the H200 calibration",
             "l1_wavefronts_per_clk": "estimate: the H200 ncu value (same SM)", "dram_latency_ns": "latency",
             "l2_latency_ns": "l2", "warp_inflight_bytes": "estimate: the H200 calibration",
             "host_latency_ns": "estimate: PCIe Gen5 round trip, not measured here"},
    "sm_100a": {"l2_latency_ns": "estimate: the H200 value",
                "l1_wavefronts_per_clk": "estimate: the H200 value",
                "warp_inflight_bytes": "estimate: the H200 calibration",
                "sms": "estimate: 148 SMs as reported by deviceQuery on B200, not in a datasheet",
                "clock_ghz": "estimate: B200 boost clock as reported by nvidia-smi, not in a datasheet",
                "l2_mib": "estimate: deviceQuery on B200", "dram_latency_ns": "estimate: H100 value + 50 ns",
                "host_link_gbs": "estimate: HGX B200 host link taken as PCIe Gen5 x16",
                "hbm_efficiency": "estimate: the H200 calibration", "launch_us": "estimate: the H200 calibration",
                "host_latency_ns": "estimate: the H200 value"},
    "sm_103a": {"l2_latency_ns": "estimate: the H200 value",
                "l1_wavefronts_per_clk": "estimate: the H200 value",
                "warp_inflight_bytes": "estimate: the H200 calibration",
                "sms": "estimate: 148 of the 160 SMs enabled, as on B200", "clock_ghz": "estimate: the B200 value",
                "l2_mib": "estimate: the B200 value", "dram_latency_ns": "estimate: the B200 value",
                "hbm_efficiency": "estimate: the H200 calibration", "launch_us": "estimate: the H200 calibration",
                "host_latency_ns": "estimate: the H200 value"},
    "sm_107a": {"l2_latency_ns": "estimate: the H200 value",
                "l1_wavefronts_per_clk": "estimate: the H200 value",
                "warp_inflight_bytes": "estimate: the H200 calibration",
                "sms": "estimate: 224 SMs (press reports of the Rubin die; no NVIDIA document)",
                "clock_ghz": "estimate", "l2_mib": "estimate: the B200 value",
                "registers_per_sm": "estimate: unchanged since Volta", "shared_per_sm": "estimate: the 10.x value",
                "issue": "estimate: the 10.x rates", "dram_latency_ns": "estimate: the B200 value",
                "host_link_gbs": "estimate: PCIe Gen6 x16", "hbm_efficiency": "estimate: the H200 calibration",
                "launch_us": "estimate: the H200 calibration", "host_latency_ns": "estimate: the H200 value"},
}


def target(arch: str) -> Target:
    try:
        return TARGETS[arch]
    except KeyError:
        raise ValueError(f"no cost-model table for {arch!r}; tables: {', '.join(TARGETS)}") from None


def gpu_target(gpu: str, arch: str) -> Target:
    """The table of part ``gpu`` (a key of ``GPUS``), which must be of ``arch``."""
    try:
        t = GPUS[gpu]
    except KeyError:
        raise ValueError(f"no cost-model table for GPU {gpu!r}; tables: {', '.join(GPUS)}") from None
    if t.arch != arch:
        raise ValueError(f"{t.gpu} is {t.arch}, not {arch}")
    return t
