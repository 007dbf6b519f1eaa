#!/usr/bin/env bash
# Issue 30 on one GPU, detached (bench/device.sh train3 starts it, train3-wait waits): the training levers not yet
# measured on a GPU (train_bench.py, 8B shape: query groups for flex attention and packing against the defaults),
# ten minutes of the fastest after warm-up, then the 27B-shape drafter. Results under /tmp/t3; /tmp/t3/done at the end. Run from bench/.
set -x
T=/tmp/t3
echo $$ > $T/pid
# T3_FLEX=tune: FlexAttention tiles tuned first (flex_tune.py; session 15 found ~1.5% of a step, so off by default),
# or the path of a flex_best.json measured before; T3_LEVERS=0 / T3_LONG=0: no levers / no ten-minute run;
# T3_LEVER_VARIANTS: the levers' variants (session 15 measured autocast -> bf16 copies -> compiled loss chunk; now
# query groups for flex attention's backward, and packing); the ten-minute run and the 27B-shape drafter take the
# levers' fastest variant (by MFU); T3_27B_TOKENS, T3_27B_VARIANTS: the 27B-shape store and variants
F=${T3_FLEX:-none}
if [[ $F == tune ]]; then F=$T/flex/flex_best.json; python3 flex_tune.py --shapes 8b --out $T/flex > $T/flex_log.txt 2>&1; fi
flex=""; [[ -e $F ]] && flex="flex=$F"
[[ ${T3_LEVERS:-1} == 0 ]] || python3 train_bench.py --minutes "${T3_LEVER_MIN:-1.25}" --warmup-minutes 0.5 --profile-steps 4 \
  --variants "${T3_LEVER_VARIANTS:-defaults;attention_groups=4;attention_groups=8;pack=true,batch_size=2;pack=true,batch_size=4}" \
  --out $T/levers > $T/levers_log.txt 2>&1
# the fastest lever's overrides as a variant ("" = the defaults), with the flex tiles if any
best=$(python3 -c "
import json, sys
v = json.load(open(sys.argv[1]))['variants']
b = max(v, key=lambda r: r['mfu'])['overrides']
print(','.join(f'{k}={x if isinstance(x, str) else json.dumps(x)}' for k, x in b.items()))
" $T/levers/train_bench.json 2>/dev/null || true)
best=${best:+$best${flex:+,$flex}}; best=${best:-$flex}
echo "fastest lever: ${best:-defaults}" > $T/best.txt
[[ ${T3_LONG:-1} == 0 ]] || python3 train_bench.py --reuse --minutes "${T3_LONG_MIN:-10.75}" --warmup-minutes 0.5 --profile-steps 4 \
  --variants "$best" --out $T/long > $T/long_log.txt 2>&1
python3 train_bench.py --shape 27b --tokens "${T3_27B_TOKENS:-300000}" --work /tmp/dflash-train-bench-27b --minutes "${T3_LEVER_MIN:-1.25}" \
  --warmup-minutes 0.5 --profile-steps 4 --variants "${T3_27B_VARIANTS:-${best:-defaults};anchors_per_sample=1024${best:+,$best}}" \
  --out $T/27b \
  > $T/27b_log.txt 2>&1
touch $T/done
