"""float32 vs float16 KV in the exact mode: agreement with transformers (bundled model)."""
import glob, json, os, sys, time
import torch
import transformers
from pagoda import LLM, SamplingParams
from pagoda.hub.paths import default_model_path

N = 64
path = default_model_path()
hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                       dtype=torch.float32).eval()
llm0 = LLM(show_progress=False)
tok = llm0.get_tokenizer()
chats = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
         "Explain what a hash table is in one sentence.", "Translate 'good morning' into Spanish and German.",
         "def fib(n):\n    # complete this Python function"]
text = " ".join(open(f).read() for f in sorted(glob.glob("/work/main/docs/*.md")))
text_ids = tok.encode(text, add_special_tokens=False)
for n in (500, 1000, 2000, 3500, 7000):
    chats.append("Summarise this text:\n" + tok.decode(text_ids[:n]))
prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True),
                      add_special_tokens=False) for c in chats]
del llm0

@torch.inference_mode()
def hf_run(ids):
    out = hf(torch.tensor([ids]), use_cache=True)
    past, lp = out.past_key_values, torch.log_softmax(out.logits[0, -1].float(), -1)
    toks, lps = [], []
    for _ in range(N):
        t = int(lp.argmax()); toks.append(t); lps.append(lp)
        out = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, lp = out.past_key_values, torch.log_softmax(out.logits[0, -1].float(), -1)
    return toks, lps

ref = [hf_run(p) for p in prompts]
res = {}
for kv in ("auto", "float16"):
    llm = LLM(show_progress=False, kv_cache_dtype=kv, max_model_len=8192)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2), use_tqdm=False)
    rows = []
    for p, (want, wlps), o in zip(prompts, ref, outs):
        got = o.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), N)
        gap = None
        if first < N:
            top = torch.topk(wlps[first], 2).values
            gap = float(top[0] - top[1])
        diff = max(abs(o.outputs[0].logprobs[i][got[i]].logprob - float(wlps[i][got[i]])) for i in range(first))
        rows.append({"prompt_tokens": len(p), "first_divergence": first, "hf_top2_gap_there": gap,
                     "max_abs_logprob_diff_before": diff})
    res[kv] = rows
    del llm
print(json.dumps(res, indent=1))
