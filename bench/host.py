"""The host a record was taken on, the packages of the venvs that ran it, and the check that two
records came from the same host before any ratio divides one by the other.

Tokens/s are a property of the host as much as of the code: the same vLLM build ran bfloat16 at 16
sequences at 3983 and 2822 tok/s on two hosts of this project's pool (records vllm_compare_bfloat16
and vllm_eager_hf_auto_bf16_18e2a0a). A record therefore names its CPU (model,
family / model / stepping, the ISA flags the kernels choose by) and core count, and `same_host`
refuses a ratio between records whose hosts differ, or whose host is unknown.
"""
from __future__ import annotations

import os
from importlib import metadata

# ISA flags that pick the CPU kernels of torch, oneDNN and vLLM (bfloat16 dot products, AMX tiles).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
# What has to match for two records to be compared.
IDENTITY = ("cpu_model", "cpu_family", "cpu_model_number", "cpu_stepping", "flags", "cpu_count")


def host(cpuinfo: str | None = None) -> dict:
    """This machine's CPU (from /proc/cpuinfo, or `cpuinfo`'s text) and core counts."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break                      # the first processor's block is enough: they are alike
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": first.get("model name"), "cpu_family": first.get("cpu family"),
            "cpu_model_number": first.get("model"), "cpu_stepping": first.get("stepping"),
            "flags": {f: f in flags for f in FLAGS}, "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "cores_per_socket": int(first["cpu cores"]) if first.get("cpu cores", "").isdigit() else None}


def host_key(h: dict | None) -> tuple | None:
    """What identifies a host (None when the record has none)."""
    if not h or not h.get("cpu_model"):
        return None
    return tuple(repr(h.get(k)) if k == "flags" else h.get(k) for k in IDENTITY)


def describe(h: dict | None) -> str:
    if not h:
        return "an unrecorded host"
    flags = ",".join(f for f, on in (h.get("flags") or {}).items() if on) or "no listed flags"
    return (f"{h.get('cpu_model')} (family {h.get('cpu_family')} model {h.get('cpu_model_number')} "
            f"stepping {h.get('cpu_stepping')}; {flags}; {h.get('cpu_count')} CPUs)")


def same_host(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> None:
    """Refuse, in one line, a ratio between two records (dicts with a `host`) of different or unknown hosts."""
    ka, kb = host_key(a.get("host")), host_key(b.get("host"))
    if ka is None or kb is None:
        which = names[0] if ka is None else names[1]
        raise ValueError(f"record {which} does not name its host: a ratio against it could be a ratio of hosts")
    if ka != kb:
        raise ValueError(f"records {names[0]} and {names[1]} come from different hosts ({describe(a['host'])} vs "
                         f"{describe(b['host'])}): their ratio would measure the hosts, not the code")


def packages() -> dict[str, str]:
    """Every distribution installed in this Python's environment, name -> version."""
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out[name.lower()] = dist.version
    return dict(sorted(out.items()))
