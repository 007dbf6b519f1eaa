"""Where copies (replicas) of the target go: one per GPU when it fits, else split across several GPUs.

A replica spanning several GPUs is written as their names joined by '+', e.g. "cuda:0+cuda:1"; it is one
worker (one process, one slot in the unit assignment). Its decoder layers are split into contiguous runs,
one per GPU, in proportion to the memory each GPU can give to weights (transformers `device_map`, which
needs accelerate). Activations flow GPU to GPU once per forward; the GPUs of a replica take turns, so a
split replica runs at about one GPU's speed: it is for targets that do not fit, not for speed.
"""

from __future__ import annotations

from dflash_pipeline.errors import CompatError

GIB = 2**30
# Layers are indivisible: a split needs some room beyond the exact weight bytes per GPU.
SPLIT_SLACK = 1.10


def replica_devices(device: str) -> list[str]:
    """ "cuda:0+cuda:1" -> ["cuda:0", "cuda:1"]; a single device -> [device]."""
    return device.split("+")


def input_device(device: str) -> str:
    """The device inputs go to and captured rows are gathered on: the replica's first."""
    return replica_devices(device)[0]


def plan_replicas(
    free_bytes: dict[str, float], weights: float, working: float, per_replica: int, can_split: bool, model: str
) -> tuple[list[str], list[str]]:
    """(replicas, warnings). `free_bytes`: the memory each device may use, in the order given;
    `weights`/`working`: bytes of one replica's weights and of one forward's working set (every GPU of a
    split replica keeps `working` free for activations). `per_replica` 0 = one device per replica where a
    replica fits one, else the fewest devices that hold one."""
    names = list(free_bytes)
    need = (weights + working) / GIB

    def fits(group: list[str]) -> bool:
        if len(group) == 1:
            return free_bytes[group[0]] >= weights + working
        room = [free_bytes[d] - working for d in group]
        return min(room) > 0 and sum(room) >= weights * SPLIT_SLACK

    def split(g: int) -> tuple[list[str], list[str]]:
        cpus = [d for d in names if not d.startswith("cuda")]
        if cpus:
            raise CompatError(
                f"{model} needs ~{need:.1f} GiB, more than one device holds, and only GPUs can "
                f"share a replica ({', '.join(cpus)} is not one). Use GPUs, lower "
                "extract.token_budget, or free memory"
            )
        if not can_split:
            raise CompatError(
                f"{model} needs ~{need:.1f} GiB, more than one GPU holds, so it must be split "
                f"across {g} GPUs, which needs accelerate: pip install accelerate"
            )
        reps = [names[i : i + g] for i in range(0, len(names) - g + 1, g)]
        left = names[len(reps) * g :]
        return ["+".join(r) for r in reps], [f"{', '.join(left)} left unused: replicas take {g} GPUs each"] * bool(left)

    if per_replica > len(names):
        raise CompatError(
            f"extract.gpus_per_replica={per_replica} but only {len(names)} device(s) are listed "
            f"({', '.join(names)}); lower it or list more devices in extract.devices"
        )
    if per_replica:
        for r in (names[i : i + per_replica] for i in range(0, len(names) - per_replica + 1, per_replica)):
            if not fits(r):
                have = ", ".join(f"{d} {free_bytes[d] / GIB:.1f} GiB" for d in r)
                raise CompatError(
                    f"one replica of {model} needs ~{weights / GIB:.1f} GiB of weights + "
                    f"{working / GIB:.1f} GiB working memory per GPU, which does not fit "
                    f"extract.gpus_per_replica={per_replica} GPU(s) ({have} usable). Raise "
                    "extract.gpus_per_replica, lower extract.token_budget, or free the devices"
                )
        return split(per_replica) if per_replica > 1 else (names, [])
    singles = [d for d in names if fits([d])]
    if singles:  # rather leave a small device idle than split a model that fits elsewhere
        left = [d for d in names if d not in singles]
        return singles, [
            f"{', '.join(left)} left unused: a replica needs ~{need:.1f} GiB and has less free there"
        ] * bool(left)
    for g in range(2, len(names) + 1):
        if all(fits(names[i : i + g]) for i in range(0, len(names) - g + 1, g)):
            return split(g)
    total = sum(free_bytes.values()) / GIB
    worst = min(names, key=lambda d: free_bytes[d])
    raise CompatError(
        f"one replica of {model} needs ~{need:.1f} GiB ({weights / GIB:.1f} GiB weights in the "
        f"compute dtype + {working / GIB:.1f} GiB working memory), but {worst} has "
        f"{free_bytes[worst] / GIB:.1f} GiB free and all {len(names)} device(s) together "
        f"{total:.1f} GiB. Lower extract.token_budget, free the devices, or use devices with more memory"
    )


def split_device_map(model_path: str, devices: list[str], room: list[float]) -> dict[str, str]:
    """A transformers `device_map` for one replica over `devices`: contiguous runs of decoder layers, sized in
    proportion to `room` (bytes each device can give to weights); modules before the layers (embeddings,
    rotary) on the first device, modules after them (final norm, and lm_head unless it is tied to the
    embeddings) on the last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from dflash_pipeline.extraction.loader import base_model, decoder_layers

    base, layers = base_model(model), decoder_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    base_name, layers_name = names[id(base)], names[id(layers)]

    def params(m) -> int:  # proportional to bytes: one dtype throughout
        return sum(p.numel() for p in m.parameters())

    sizes = [params(layer) for layer in layers]
    others = [(n, m) for n, m in base.named_children() if m is not layers]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = [(n, m) for n, m in model.named_children() if n != base_name.split(".")[0]]  # lm_head
    front = sum(params(m) for n, m in others if n in ("embed_tokens", "rotary_emb"))
    back = 0 if tied else sum(params(m) for _, m in heads)  # loaded though never run
    total, share = front + sum(sizes) + back, [r / sum(room) for r in room]
    out: dict[str, str] = {}
    d, used = 0, front
    for i, size in enumerate(sizes):
        # Move to the next device once this one has its share (by cumulative bytes, so rounding never
        # leaves the last device with everything).
        while d < len(devices) - 1 and used + size / 2 > total * sum(share[: d + 1]):
            d += 1
        out[f"{layers_name}.{i}"] = devices[d]
        used += size
    first, last = devices[0], out[f"{layers_name}.{len(sizes) - 1}"]
    for n, _ in others:
        out[f"{base_name}.{n}" if base_name else n] = first if n in ("embed_tokens", "rotary_emb") else last
    for n, _ in heads:
        out[n] = first if tied else last
    return out


def device_map_summary(device_map: dict[str, str]) -> str:
    """ "cuda:0: 18 layers, cuda:1: 18 layers" (for logs and the probe report)."""
    counts: dict[str, int] = {}
    for name, dev in device_map.items():
        if name.split(".")[-2:-1] == ["layers"]:
            counts[dev] = counts.get(dev, 0) + 1
    return ", ".join(f"{d}: {c} layers" for d, c in counts.items())
