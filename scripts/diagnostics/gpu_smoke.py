"""Do the core paths (reference decoder, AR on the stage code, HF generate) run on one GPU in bf16?

Usage (GPU machine, repo root, SmolLM2 GGUF at $SPD_GGUF):
``PYTHONPATH=$PWD:$PYTHONPATH python scripts/diagnostics/gpu_smoke.py``
-> prints a JSON line per check.
"""
import json
import time

import torch

from spd_ds import builder
from spd_ds.config import load_config
from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.drafters import HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.head import SpeculationHead
from spd_ds.partition import StagePartition


def main():
    import transformers
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)
    cfg = load_config("launch/configs/smollm2_spd.yaml", ["model.dtype=bfloat16", "model.device=cuda"])
    arch = builder.build_arch(cfg)
    tok = builder.load_tokenizer(arch)
    prompts = [builder.encode_prompt(tok, t) for t in [
        "What is the capital of France?", "Write a Python function to reverse a list.",
        "Explain photosynthesis in three sentences."]]
    eos = builder.eos_token_ids(cfg, arch, tok)
    for n in (2, 3):
        part = builder.build_partition(cfg, arch) if n == 2 else StagePartition.build(arch.num_layers, n)
        target = builder.build_target(cfg, arch, part)
        head = SpeculationHead(arch, part)
        ar = ARDecoder(target, eos_token_ids=eos, max_len=1024)
        for p in prompts:
            torch.cuda.synchronize(); t0 = time.perf_counter()
            a = ar.generate(p, 64)
            torch.cuda.synchronize(); t_ar = time.perf_counter() - t0
            dr = OracleDrafter(list(p) + a.tokens, 0.8, base=HeadDrafter(head, 1024, torch.bfloat16, "cuda"))
            torch.cuda.synchronize(); t0 = time.perf_counter()
            r = SPDReferenceDecoder(target, dr, eos_token_ids=eos, max_len=1024).generate(p, 64)
            torch.cuda.synchronize(); t_spd = time.perf_counter() - t0
            first_div = next((i for i, (x, y) in enumerate(zip(a.tokens, r.tokens)) if x != y), None)
            print(json.dumps({"n": n, "identical": a.tokens == r.tokens, "first_divergence": first_div,
                              "ar_tok_s": len(a.tokens) / t_ar, "spd_ref_s": t_spd,
                              "stage_s": r.metrics.stage_forward_s, "head_s": r.metrics.head_s,
                              "eal": r.metrics.equivalent_accept_length}), flush=True)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(arch.model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompts[0]], device="cuda")
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, do_sample=False)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        torch.cuda.synchronize()
    print(json.dumps({"hf_generate_tok_s": 64 / (time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
