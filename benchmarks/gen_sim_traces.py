"""Write the small SYNTHETIC sample traces of pdproto/sim/traces/.

None of these rows come from a real trace.  They are drawn from lognormal
length distributions whose medians follow published figures, with Poisson
arrivals at the published mean rates, and written in each trace format the
simulator reads (pdproto/sim/_workload.py, load_trace):

* azure_code_synthetic.csv, azure_conv_synthetic.csv: the Azure LLM
  inference trace 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).
  Medians: coding prompt 1500 / output 13 tokens, conversation 1020 / 129
  (Splitwise, ISCA'24, §III, as the paper reports its Azure traces).
  Rates: coding about 8.8K requests in about 57 min (2.6 rps; the figure in
  ../shared/research/sim-anchors.md §4), conversation 5.3 rps (the mean rate
  of Vidur's splitwise_conv.csv over its first 188 s).
* splitwise_synthetic.csv: SplitwiseSim's CSV, the conversation mix.
* vidur_synthetic.csv: Vidur's CSV, the coding mix.
* mooncake_synthetic.jsonl: the Mooncake FAST'25 JSONL (timestamp in ms,
  512-token hash_ids, none shared); means in 12,035 / out 343 tokens
  (Mooncake's conversation trace), so medians mean / exp(sigma²/2).
* sample.jsonl: our JSONL (``arrival``, ``prompt_len``, ``output_len``),
  the conversation mix.

The sigmas (1.0 for prompts, 0.8 for outputs) and the clips are our choice,
not published.  Run ``python benchmarks/gen_sim_traces.py`` from the repo
root; it rewrites the files deterministically (seed 17).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
from datetime import datetime, timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdproto.sim import Arrival, Lengths, WorkloadSpec, make_workload  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "pdproto" / "sim" / "traces"
ROWS = 300
SEED = 17
START = datetime(2023, 11, 16, 18, 15, 46)

CODE = WorkloadSpec(Arrival.poisson(2.6), Lengths.lognormal(1500, 1.0, 2, 8000),
                    Lengths.lognormal(13, 0.8, 1, 2000))
CONV = WorkloadSpec(Arrival.poisson(5.3), Lengths.lognormal(1020, 1.0, 2, 8000),
                    Lengths.lognormal(129, 0.8, 1, 2000))
MOONCAKE = WorkloadSpec(Arrival.poisson(1.0), Lengths.lognormal(12035 / math.exp(0.5), 1.0, 2, 128000),
                        Lengths.lognormal(343 / math.exp(0.32), 0.8, 1, 4000))


def azure(spec: WorkloadSpec, name: str) -> None:
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for r in make_workload(spec, ROWS, SEED):
            stamp = START + timedelta(seconds=r.arrival)
            fh.write(f"{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond:06d}0,{r.prompt_len},{r.output_len}\n")


def splitwise(spec: WorkloadSpec, name: str) -> None:
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size\n")
        for i, r in enumerate(make_workload(spec, ROWS, SEED)):
            fh.write(f"{i},2,0,{r.arrival:.6f},1,{r.prompt_len},{r.output_len}\n")


def vidur(spec: WorkloadSpec, name: str) -> None:
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
        for r in make_workload(spec, ROWS, SEED):
            fh.write(f"{r.arrival:.6f},{r.prompt_len},{r.output_len}\n")


def mooncake(spec: WorkloadSpec, name: str) -> None:
    block = 0
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as fh:
        for r in make_workload(spec, 100, SEED):
            blocks = -(-r.prompt_len // 512)
            ids = list(range(block, block + blocks))
            block += blocks
            fh.write(json.dumps({"timestamp": round(r.arrival * 1000), "input_length": r.prompt_len,
                                 "output_length": r.output_len, "hash_ids": ids}) + "\n")


def ours(spec: WorkloadSpec, name: str) -> None:
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as fh:
        for r in make_workload(spec, ROWS, SEED):
            fh.write(json.dumps({"arrival": round(r.arrival, 6), "prompt_len": r.prompt_len,
                                 "output_len": r.output_len}) + "\n")


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    azure(CODE, "azure_code_synthetic.csv")
    azure(CONV, "azure_conv_synthetic.csv")
    splitwise(CONV, "splitwise_synthetic.csv")
    vidur(CODE, "vidur_synthetic.csv")
    mooncake(MOONCAKE, "mooncake_synthetic.jsonl")
    ours(CONV, "sample.jsonl")
    for path in sorted(OUT.iterdir()):
        print(f"{path.name:28} {path.stat().st_size:>7,} bytes")
