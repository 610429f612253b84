"""The results file's JSON Schema (draft 2020-12), version ``te_lab.benchmarks/1``.

A results file holds:

- ``schema``: ``"te_lab.benchmarks/1"``; ``command``: the command line that produced it;
  ``config``: the options it ran with;
- ``environment``: machine, threads, load, versions, measured copy bandwidth, the device's
  peak (see ``environment.describe``);
- ``ops``: one item per op case, dtype, size and mode, each with its ``contenders``
  (times in ms: ``first_call_ms``, ``samples_ms`` in round order, ``median_ms``,
  ``spread_ms`` = half the interquartile range; achieved ``gbs`` = ``bytes_moved`` /
  median and its fraction of the copy bandwidth and of the device peak; ``tflops`` where
  the op's FLOPs are counted; ``peak_memory_bytes`` above what was allocated before the
  call) and ``speedups``;
- ``models``: one item per model and mode (``train``, ``inference``), contenders with
  ``tokens_per_s``, ``setup_s`` (fuse time), ``time_to_first_step_s``, and ``speedups``;
- ``generation`` (where the profile runs it): one item per model, batch and prompt length,
  each mode's prefill and per-token decode samples (ms, round order), tokens/s, first
  call, whether its tokens equal eager's, and ``speedups`` per ``phase``;
- ``failures``: an op case or model that raised mid-run (``where``, ``error``); the run
  goes on without it;
- ``targets``: issue 9's targets, each ``met`` true, false, or null when not measured.

A speedup is ``median(over) / median(contender)`` (above 1: the contender is faster)
with a 95% bootstrap interval over paired rounds and the quartiles of the per-round
ratios (see ``stats.py``). A contender whose first call failed has ``error`` set and
null figures.
"""

from __future__ import annotations

SCHEMA_ID = "te_lab.benchmarks/1"

_NUMBER = {"type": "number"}
_OPTIONAL_NUMBER = {"type": ["number", "null"]}
_OPTIONAL_STRING = {"type": ["string", "null"]}
_SAMPLES = {"type": "array", "items": _NUMBER}

SPEEDUP = {
    "type": "object",
    "required": ["contender", "over", "value", "interval_low", "interval_high", "round_median", "round_q1",
                 "round_q3"],
    "properties": {"contender": {"type": "string"}, "over": {"type": "string"}, "value": _NUMBER,
                   "interval_low": _NUMBER, "interval_high": _NUMBER, "round_median": _NUMBER,
                   "round_q1": _NUMBER, "round_q3": _NUMBER},
    "additionalProperties": False,
}

OP_CONTENDER = {
    "type": "object",
    "required": ["name", "kind", "backend", "auto", "error", "first_call_ms", "samples_ms", "median_ms",
                 "spread_ms", "gbs", "fraction_of_copy_bandwidth", "fraction_of_peak_bandwidth", "tflops",
                 "fraction_of_peak_flops", "peak_memory_bytes"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["eager", "torch.compile", "te_lab", "liger", "torch"]},
        "backend": _OPTIONAL_STRING, "auto": {"type": "boolean"}, "error": _OPTIONAL_STRING,
        "first_call_ms": _OPTIONAL_NUMBER, "samples_ms": _SAMPLES, "median_ms": _OPTIONAL_NUMBER,
        "spread_ms": _OPTIONAL_NUMBER, "gbs": _OPTIONAL_NUMBER, "fraction_of_copy_bandwidth": _OPTIONAL_NUMBER,
        "fraction_of_peak_bandwidth": _OPTIONAL_NUMBER, "tflops": _OPTIONAL_NUMBER,
        "fraction_of_peak_flops": _OPTIONAL_NUMBER, "peak_memory_bytes": {"type": ["integer", "null"]},
    },
    "additionalProperties": False,
}

OP_RESULT = {
    "type": "object",
    "required": ["op", "case", "title", "dtype", "size", "mode", "bytes_moved", "flops", "contenders", "speedups"],
    "properties": {
        "op": {"type": "string"}, "case": {"type": "string"}, "title": {"type": "string"},
        "dtype": {"enum": ["float32", "bfloat16", "float16"]},
        "size": {"type": "object", "required": ["tokens", "hidden"],
                 "properties": {"tokens": {"type": "integer"}, "hidden": {"type": "integer"}}},
        "mode": {"enum": ["forward", "backward", "forward+backward", "step"]},
        "bytes_moved": {"type": "integer"}, "flops": {"type": ["integer", "null"]},
        "contenders": {"type": "array", "items": OP_CONTENDER, "minItems": 1},
        "speedups": {"type": "array", "items": SPEEDUP},
    },
    "additionalProperties": False,
}

MODEL_CONTENDER = {
    "type": "object",
    "required": ["name", "error", "setup_s", "first_call_ms", "samples_ms", "median_ms", "spread_ms",
                 "tokens_per_s", "time_to_first_step_s", "peak_memory_bytes"],
    "properties": {
        "name": {"enum": ["eager", "torch.compile", "te_lab", "te_lab (fusion only)", "torch.compile(te_lab)"]},
        "error": _OPTIONAL_STRING, "setup_s": _NUMBER, "first_call_ms": _OPTIONAL_NUMBER, "samples_ms": _SAMPLES,
        "median_ms": _OPTIONAL_NUMBER, "spread_ms": _OPTIONAL_NUMBER, "tokens_per_s": _OPTIONAL_NUMBER,
        "time_to_first_step_s": _OPTIONAL_NUMBER, "peak_memory_bytes": {"type": ["integer", "null"]},
    },
    "additionalProperties": False,
}

MODEL_RESULT = {
    "type": "object",
    "required": ["model", "parameters", "batch", "seq", "tokens", "fuse_s", "fusion", "not_fused", "mode", "check",
                 "contenders", "speedups"],
    "properties": {
        "model": {"type": "string"}, "parameters": {"type": "integer"}, "batch": {"type": "integer"},
        "seq": {"type": "integer"}, "tokens": {"type": "integer"}, "fuse_s": _NUMBER, "fusion": {"type": "string"},
        "not_fused": {"type": "array", "items": {"type": "string"}},
        "mode": {"enum": ["train", "inference"]},
        "check": {"type": ["object", "null"], "required": ["compared", "max_abs_difference"],
                  "properties": {"compared": {"type": "string"}, "max_abs_difference": _NUMBER}},
        "contenders": {"type": "array", "items": MODEL_CONTENDER, "minItems": 1},
        "speedups": {"type": "array", "items": SPEEDUP},
    },
    "additionalProperties": False,
}

TARGET = {
    "type": "object",
    "required": ["device", "target", "met", "measured", "detail"],
    "properties": {"device": {"enum": ["cpu", "gpu"]}, "target": {"type": "string"},
                   "met": {"type": ["boolean", "null"]}, "measured": {"type": "string"},
                   "detail": {"type": "array", "items": {"type": "string"}}},
    "additionalProperties": False,
}

DISPATCH_RESULT = {
    "type": "object",
    "required": ["case", "tokens", "hidden", "backend", "te_lab_op_calls", "median_us", "overhead_per_call_us",
                 "te_lab_vs_eager"],
    "properties": {
        "case": {"type": "string"}, "phase": {"enum": ["training", "prefill", "decode"]},
        "tokens": {"type": "integer"}, "hidden": {"type": "integer"},
        "backend": {"type": "string"}, "te_lab_op_calls": {"type": "integer"},
        "median_us": {"type": "object", "required": ["te_lab", "kernels", "eager"]},
        "overhead_per_call_us": _OPTIONAL_NUMBER, "te_lab_vs_eager": {"type": "object"},
    },
    "additionalProperties": False,
}

GENERATION_RESULT = {
    "type": "object",
    "required": ["model", "batch", "prompt", "new_tokens", "fused_modules", "kv_cache", "modes", "speedups"],
    "properties": {
        "model": {"type": "string"}, "batch": {"type": "integer"}, "prompt": {"type": "integer"},
        "new_tokens": {"type": "integer"}, "fused_modules": {"type": "integer"}, "kv_cache": {"type": "boolean"},
        "modes": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["error", "first_call_ms", "prefill_ms", "decode_ms_per_token", "prefill_tokens_per_s",
                         "decode_tokens_per_s", "tokens_identical_to_eager"],
            "properties": {"error": _OPTIONAL_STRING, "first_call_ms": _OPTIONAL_NUMBER, "prefill_ms": _SAMPLES,
                           "decode_ms_per_token": _SAMPLES, "prefill_tokens_per_s": _OPTIONAL_NUMBER,
                           "decode_tokens_per_s": _OPTIONAL_NUMBER,
                           "tokens_identical_to_eager": {"type": ["boolean", "null"]}},
            "additionalProperties": False}},
        "speedups": {"type": "array", "items": {"type": "object", "required": ["phase", *SPEEDUP["required"]]}},
    },
    "additionalProperties": False,
}

FAILURE = {
    "type": "object", "required": ["where", "error"],
    "properties": {"where": {"type": "string"}, "error": {"type": "string"}}, "additionalProperties": False,
}

RESULTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "te_lab benchmark results",
    "type": "object",
    "required": ["schema", "command", "config", "environment", "ops", "models", "failures", "targets"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "command": {"type": "string"},
        "config": {"type": "object"},
        "environment": {
            "type": "object",
            "required": ["created_utc", "device", "device_name", "parallel_units", "cpu_count", "torch_threads",
                         "load_average_1min", "python", "platform", "versions", "copy_bandwidth_gbs", "peak"],
            "properties": {"copy_bandwidth_gbs": _NUMBER, "torch_threads": {"type": "integer"},
                           "versions": {"type": "object", "required": ["te_lab", "torch"]}},
        },
        "ops": {"type": "array", "items": OP_RESULT},
        "models": {"type": "array", "items": MODEL_RESULT},
        "dispatch": {"type": "array", "items": DISPATCH_RESULT},
        "generation": {"type": "array", "items": GENERATION_RESULT},
        "failures": {"type": "array", "items": FAILURE},
        "targets": {"type": "array", "items": TARGET},
    },
    "additionalProperties": False,
}
