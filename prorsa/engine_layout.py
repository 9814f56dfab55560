"""Which accelerators each engine `prorsa up` starts gets: its `CUDA_VISIBLE_DEVICES` (pure).

An engine serving a model with tensor, pipeline or data parallelism runs several workers, one per device; every
engine of one host must see a disjoint set of them, or all land on device 0. `prorsa up --devices-per-engine N`
gives engine i the i-th group of N devices from `--devices` (default: 0, 1, 2, ...), and refuses a layout that
needs more devices than listed. The engine's own parallelism comes from its engine arguments
(`--engine-arg tensor_parallel_size=N`, `data_parallel_size`, `enable_expert_parallel`), which vLLM checks against
the devices it sees.
"""

from __future__ import annotations


def parse_devices(text: str) -> list[str]:
    """ "0,1,2,3" -> ["0", "1", "2", "3"]; also ranges "0-7". Raises ValueError on anything else."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"device range {part!r} is not LOW-HIGH")
            out += [str(i) for i in range(int(lo), int(hi) + 1)]
        elif part.isdigit():
            out.append(part)
        else:
            raise ValueError(f"device {part!r} is not a device index")
    if len(set(out)) != len(out):
        raise ValueError(f"devices {text!r} list a device twice")
    return out


def device_groups(engines: int, per_engine: int, devices: list[str] | None = None) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each engine ("" for all when `per_engine` is 0: no placement). Raises
    ValueError when the devices do not suffice."""
    if per_engine <= 0:
        return [""] * engines
    pool = devices if devices is not None else [str(i) for i in range(engines * per_engine)]
    need = engines * per_engine
    if len(pool) < need:
        raise ValueError(
            f"{engines} engines x {per_engine} devices each need {need} devices, {len(pool)} listed "
            f"({','.join(pool)})"
        )
    return [",".join(pool[i * per_engine : (i + 1) * per_engine]) for i in range(engines)]
