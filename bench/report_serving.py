"""The performance page's sections on serving, each from its bench/results/*.json: the server
under concurrent streams, shared prefixes and the prefix cache, speculation (n-gram and draft),
structured outputs' cost, and the engine on a shared host. bench/report.py puts them in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_format import bundle_name, table  # noqa: E402


def serve(d: dict[str, Any]) -> str:
    rows = []
    for lv in d["levels"]:
        engine = lv.get("engine_only_tokens_per_s")
        rows.append(
            [
                lv["concurrency"],
                f"{lv['output_tokens_per_s']:.0f}",
                f"{lv['throughput_vs_first']:.2f}×",
                f"{engine:.0f}" if engine else "-",
                f"{lv['output_tokens_per_s'] / engine:.0%}" if engine else "-",
                f"{lv['ttft']['median_ms']:.1f}",
                f"{lv['tpot']['median_ms']:.2f}",
                f"{lv['itl']['p99_ms']:.2f}",
            ]
        )
    return (
        f"**Serving** (`bench/serve.py`, bundle `{bundle_name(d['bundle'])}`): concurrent "
        f"streaming clients against `neffkit run` ({d['input_len']}-token prompts, "
        f"{d['output_len']} output "
        "tokens, ignore_eos), vLLM "
        "bench-serve definitions; *engine alone* is `LLM.generate` on the same work with no "
        "HTTP, in the same run.\n\n"
        + table(
            [
                "streams",
                "output tok/s",
                "vs 1 stream",
                "engine alone tok/s",
                "server/engine",
                "TTFT median ms",
                "TPOT median ms",
                "ITL p99 ms",
            ],
            rows,
        )
    )


def serve_prefix(d: dict[str, Any]) -> str:
    rows = []
    for on, off in zip(d["prefix_caching_on"], d["prefix_caching_off"], strict=True):
        rows.append(
            [
                on["concurrency"],
                f"{on['output_tokens_per_s']:.0f}",
                f"{off['output_tokens_per_s']:.0f}",
                f"{on['ttft']['median_ms']:.1f}",
                f"{off['ttft']['median_ms']:.1f}",
            ]
        )
    return (
        f"**Serving a shared prefix** (`bench/serve.py --shared-prefix {d['shared_prefix']}`, "
        f"bundle `{bundle_name(d['bundle'])}`): each prompt one of {d['prefixes']} shared "
        f"{d['shared_prefix']}-token prefixes and {d['input_len']} tokens of its own, "
        f"{d['output_len']} output tokens; the same requests against a server with prefix "
        "caching and one with `--no-prefix-caching`, in one run.\n\n"
        + table(
            [
                "streams",
                "tok/s cached",
                "tok/s uncached",
                "TTFT median ms cached",
                "TTFT median ms uncached",
            ],
            rows,
        )
    )


def prefix_cache(d: dict[str, Any]) -> str:
    return (
        f"**Prefix cache hit** (`bench/prefix_cache.py`, `{bundle_name(d['bundle'])}`): a "
        f"{d['question_tokens']}-token question after a {d['system_prompt_tokens']}-token "
        f"system prompt, time to first token through the engine, median of {d['pairs']} "
        f"alternating pairs: {d['ttft_cold_ms']:.0f} ms cold, {d['ttft_hit_ms']:.0f} ms with "
        f"the system prompt cached ({d['speedup']:.1f}x); the hits' tokens equal uncached "
        f"runs': {'yes' if d['hit_tokens_equal_uncached'] else 'no'}."
    )


def speculation(d: dict[str, Any]) -> str:
    def group(name: str) -> str:
        g = d[name]
        lengths = ", ".join(f"{a:.2f}" for a in g["mean_acceptance_length"])
        return (
            f"{g['speedup_median']:.2f}x decode tokens/s (median of {g['prompts']} prompts; "
            f"mean acceptance lengths {lengths})"
        )

    draft = d.get("draft")
    title = "draft-model speculation" if draft else "n-gram speculation"
    flag = " --draft" if draft else ""
    proposing = (
        f" The draft ({draft}) proposes K tokens in {d['draft_step_ms']:.1f} ms (one catch-up "
        "call and K - 1 decode steps), counted in decode time."
        if draft
        else ""
    )
    return (
        f"**{title}** (`bench/speculation.py{flag}`, `{bundle_name(d['bundle'])}`, batch 1, "
        f"K = {d['num_tokens']}): a verify step costs {d['verify_step_ms']:.1f} ms against "
        f"{d['decode_step_ms']:.1f} ms for a decode step ({d['verify_over_decode']:.2f}x)."
        f"{proposing} Prompts that quote their input: {group('quoting')}; open questions: "
        f"{group('open')}. Outputs with and without speculation are equal."
    )


def structured(d: dict[str, Any]) -> str:
    rows = [
        [
            r["batch"],
            *(f"{v:.2f}" for v in r["ms_per_step"].values()),
            f"{r['unconstrained_rows_with_inputs_vs_plain']:.3f}x",
            f"{r['json_schema_rows_vs_unconstrained']:.3f}x",
        ]
        for r in d["rows"]
    ]
    header = [
        "batch",
        "plain graphs ms",
        "with logit inputs ms",
        "JSON-schema rows ms",
        "inputs / plain",
        "schema / unconstrained",
    ]
    return (
        f"**Structured outputs** (`bench/structured.py`, {d['model']}): what the token bitmask, "
        "penalty and bias inputs cost rows that use none of them, and what following a JSON "
        f"schema adds (llguidance's mask on the host, applied in the graph). {d['method']}.\n\n"
        + table(header, rows)
    )


def threads(d: dict[str, Any]) -> str:
    rows = [
        [r["setting"], f"{r['quiet_tok_s']:.0f}", f"{r['contended_tok_s']:.0f}", f"{r['kept']:.0%}"]
        for r in d["rows"]
    ]
    header = ["engine setting", "quiet tok/s", "beside a busy process tok/s", "kept"]
    return (
        f"**A shared host** (`bench/threads.py`, {d['model']}): {d['method']}. Under "
        f"`taskset -c 0` the engine takes {d['taskset_c0_engine_threads']} thread(s) by "
        "default.\n\n" + table(header, rows)
    )


def threads_offline(d: dict[str, Any]) -> str:
    """bench/threads_offline.py: offline generation quiet and beside a busy process."""
    rows = [
        [
            r["setting"],
            r["host"],
            f"{r['wall_s']:.2f}",
            f"{r['vs_quiet_default']:.2f}×",
            ", ".join(str(t) for t in r["threads_at_end"]),
        ]
        for r in d["rows"]
    ]
    header = ["threads", "host", "generation s", "vs quiet default", "threads at the end"]
    return (
        f"**Offline on a shared host** (`bench/threads_offline.py`, {d['model']}): {d['method']}. "
        "The default's governor tries one thread fewer after the first steps and keeps the "
        "faster count.\n\n" + table(header, rows)
    )


def lora(d: dict[str, Any]) -> str:
    """bench/lora.py: the decode step with adapter slots, and an adapter's load."""
    steps, load = d["step_ms"], d["adapter_load"]
    rows = [
        ["base bundle, base rows", f"{steps['base']:.2f}", "1.00×"],
        [
            f"{d['max_loras']} slots, base rows",
            f"{steps['slots_base_rows']:.2f}",
            f"{d['ratio_base_rows_vs_base']:.2f}×",
        ],
        [
            f"{d['max_loras']} slots, {d['max_loras']} distinct adapters",
            f"{steps['slots_4_adapters']:.2f}",
            f"{d['ratio_4_adapters_vs_base']:.2f}×",
        ],
    ]
    return (
        f"**Adapters** (`bench/lora.py`, {d['model']}, batch {d['batch']}, rank {d['rank']} on "
        f"every projection; {d['rounds']} alternating rounds, medians): the decode step, host "
        "work included"
        + (
            f" (the median of each round's ratio: {d['ratio_4_adapters_vs_base_paired']:.2f}×)"
            if "ratio_4_adapters_vs_base_paired" in d
            else ""
        )
        + ". Loading a rank-"
        f"{d['rank']} adapter: read and checked {load['read_ms']:.1f} ms, written into a slot "
        f"{load['write_ms']:.1f} ms.\n\n" + table(["decode batch", "step ms", "vs base"], rows)
    )


def serve_lora(d: dict[str, Any]) -> str:
    """bench/serve.py --adapters: the server with adapters, and a load while it serves."""
    base, mixed, load = d["base"], d["adapters"], d["load_during_base"]
    rows = [
        [
            "base bundle, base model",
            f"{base['output_tokens_per_s']:.0f}",
            f"{base['itl_median_ms']:.1f}",
        ],
        [
            f"slots, a distinct adapter for each of {d['clients']} clients",
            f"{mixed['output_tokens_per_s']:.0f}",
            f"{mixed['itl_median_ms']:.1f}",
        ],
    ]
    return (
        f"**Serving adapters** (`bench/serve.py --adapters`, {d['clients']} streaming clients): "
        "the base bundle against the bundle with slots serving a distinct adapter per client "
        f"({mixed['itl_median_ms'] / base['itl_median_ms']:.2f}× the inter-token latency). "
        f"`POST /v1/load_lora_adapter` while {d['clients']} requests decode, "
        f"{load['loads']} times: answered in {load['load_ms']:.0f} ms (median); the longest "
        "gap between two tokens of any request during a load: "
        f"{load['longest_gap_during_load_median_ms']:.0f} ms (median of the loads; "
        f"{load['longest_gap_during_load_ms']:.0f} ms at most), against "
        f"{load['longest_gap_in_control_windows_median_ms']:.0f} ms in windows as long between "
        f"the loads, a median gap (a step) of {load['median_gap_ms']:.0f} ms and a p99 gap of "
        f"{load['p99_gap_outside_load_ms']:.0f} ms outside them: a load adds "
        f"{load['stall_added_median_ms']:.0f} ms to the step it lands in.\n\n"
        + table(["server", "output tok/s", "ITL median ms"], rows)
    )


def serve_preemption(d: dict[str, Any]) -> str:
    """bench/serve.py --preemption: serving under a KV pool that forces preemption."""
    med = d["medians"]
    rows = [
        [
            f"{label} ({d['blocks'][key] - 1} blocks of {d['block_size']} tokens)",
            f"{med[key]['output_tokens_per_s']:.0f}",
            f"{med[key]['itl_median_ms']:.1f}",
            f"{med[key]['longest_gap_ms']:.0f}",
            f"{med[key]['preemptions']:.0f}",
        ]
        for key, label in (("whole_pool", "whole"), ("pool_48_blocks", "smaller"))
    ]
    return (
        f"**Serving under KV pressure** (`bench/serve.py --preemption`, {d['model']}, "
        f"{d['clients']} streaming clients x {d['requests_per_client']} requests of "
        f"{d['input_len']} + {d['output_len']} tokens, {d['rounds']} alternating rounds, "
        "medians): the bundle's whole KV pool holds every running request at its longest; "
        "`--num-gpu-blocks-override` gives a pool that holds 3, so requests are admitted on "
        "their prompts and preempted by recompute as they grow "
        f"({d['throughput_preempting_vs_whole']:.2f}x the throughput; the longest gap is a "
        "preempted request waiting to run again).\n\n"
        + table(["KV pool", "output tok/s", "ITL median ms", "longest gap ms", "preemptions"], rows)
    )


def kv_memory(d: dict[str, Any]) -> str:
    """bench/kv_memory.py: sequences one KV budget holds with and without KV groups."""
    one, groups = d["rows"]["one_pool"], d["rows"]["kv_groups"]
    rows = []
    for key, row in (("one_pool", one), ("kv_groups", groups)):
        label = "one pool (`hybrid: false`)" if key == "one_pool" else "KV groups"
        cells = [label, f"{row['cache_bytes'] / 2**20:.0f} MiB"]
        for n in (4096, d["context"]):
            r = row[f"tokens_{n}"]
            cells += [str(r["most_decoding"]), str(r["most_at_once"]), str(r["preemptions"])]
        rows.append(cells)
    ratio = d["ratios"]
    long = ratio[f"tokens_{d['context']}"]["most_decoding"]
    heads = ["cache", "4k: decoding", "4k: admitted", "4k: preempted"]
    heads += [f"{d['context'] // 1024}k: decoding", "admitted", "preempted"]
    return (
        f"**Sequences one KV budget holds** (`bench/kv_memory.py`, {d['model']}: 3 full and 15 "
        f"sliding layers, window 512; context {d['context']}, `kv_cache.memory_mb: "
        f"{d['memory_mb']}`): neffkit's scheduler driven over each bundle's pools with "
        f"{d['requests']} sequences of 4096 and of {d['context']} tokens ({d['output_tokens']} "
        "of them generated), the graphs' work skipped. KV groups hold "
        f"{ratio['tokens_4096']['most_decoding']:.2f}x the 4k sequences decoding at once and "
        f"{long:.2f}x the "
        f"{d['context'] // 1024}k ones; the budget is split for sequences of the largest context, "
        "so at 4k the sliding pool is the limit.\n\n" + table(["bundle", *heads], rows)
    )


def replicas(d: dict[str, Any]) -> str:
    """bench/replicas.py: data-parallel replicas against one engine, and the routing's cost."""
    rows = [
        [
            name,
            f"{s['output_tokens_per_s']:.1f}",
            f"{s['ttft_median_ms']:.0f}",
            f"{s['tpot_median_ms']:.1f}",
        ]
        for name, s in d["summary"].items()
    ]
    header = ["server", "output tok/s", "median TTFT ms", "median TPOT ms"]
    route = d["routing"]
    return (
        f"**Data-parallel replicas** (`bench/replicas.py`, {d['bundle']}, {d['cpus']} CPUs, "
        f"concurrency {d['concurrency']}, {d['requests']} streamed requests of {d['input_len']} "
        f"random tokens in, {d['output_len']} out, {d['rounds']} alternating rounds, medians): "
        f"replicas / one engine = {d['data_parallel_vs_one']:.2f}×. The front's routing "
        f"decision takes {route['p50_us']:.0f} µs (p50) and {route['p99_us']:.0f} µs (p99) a "
        "request.\n\n" + table(header, rows)
    )
