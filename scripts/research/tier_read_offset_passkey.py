"""The exact tier's passkey (noise filler, depth 0.5) with the read's log-scale lowered, or the read off.

    python scripts/research/tier_read_offset_passkey.py readdown1.5:256 8192 5 [MODEL]   # log-scale - 1.5, tier 256
    python scripts/research/tier_read_offset_passkey.py noread:256 8192 3               # the read's share 0
    python scripts/research/tier_read_offset_passkey.py tier:1024 8192 5                # the tier alone changed
"""
import json, sys, torch
from retrofit.eval import loading
from retrofit.eval.passkey import run_passkey
from retrofit.layers.tier import set_tier, tier_layers
torch.set_num_threads(1)
variant, length, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok = loading.load_model(sys.argv[4] if len(sys.argv) > 4 else "runs/hh-fit", device="cpu", dtype=None)
model.eval()
cap = int(variant.split(":")[1])
set_tier(model, cap, "recall", 64)
if variant.startswith("readdown"):  # readdown<d>:N: the read's log-scale lowered by d (its weight / e^d)
    drop = float(variant.split(":")[0][len("readdown"):])
    with torch.no_grad():
        for layer in tier_layers(model):
            layer.memory_scale.bias -= drop
if variant.startswith("noread"):  # the read's log-scale pushed to -1e4: its share is 0; the tier still chosen through it
    with torch.no_grad():
        for layer in tier_layers(model):
            layer.memory_scale.bias -= 1e4
res = run_passkey(model, tokenizer=tok, lengths=[length], depths=[0.5], trials=trials, haystack="noise",
                  chat_template="off", out=f"runs/tier-variant-{variant.replace(':', '')}-{length}", progress=False,
                  command=f"python scripts/research/tier_read_offset_passkey.py {variant} {length} {trials}")
print(variant, length, res["table"])
