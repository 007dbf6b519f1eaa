#!/usr/bin/env bash
# Issue 30 on one GPU, detached (bench/device.sh train3 starts it, train3-wait waits): FlexAttention tiles
# (flex_tune.py), the training levers one by one (train_bench.py, 8B shape), ten minutes with every lever after
# warm-up, then the 27B-shape drafter. Results under /tmp/t3; /tmp/t3/done at the end. Run from bench/.
set -x
T=/tmp/t3
echo $$ > $T/pid
# T3_FLEX=PATH: a flex_best.json measured before (the tuning is skipped); T3_LEVERS=0 / T3_LONG=0: no levers / no
# ten-minute run; T3_LEVER_VARIANTS: the levers' variants (e.g. "defaults;pack=true,batch_size=2"); T3_27B_TOKENS,
# T3_27B_VARIANTS: the 27B-shape store and variants
F=${T3_FLEX:-$T/flex/flex_best.json}
[[ -n ${T3_FLEX:-} ]] || python3 flex_tune.py --shapes 8b --out $T/flex > $T/flex_log.txt 2>&1
flex=""; [[ -e $F ]] && flex="flex=$F"
[[ ${T3_LEVERS:-1} == 0 ]] || python3 train_bench.py --minutes "${T3_LEVER_MIN:-1.25}" --warmup-minutes 0.5 --profile-steps 4 \
  --variants "${T3_LEVER_VARIANTS:-precision=autocast,ce=eager;precision=bf16,ce=eager;defaults${flex:+;$flex}}" --out $T/levers \
  > $T/levers_log.txt 2>&1
[[ ${T3_LONG:-1} == 0 ]] || python3 train_bench.py --reuse --minutes "${T3_LONG_MIN:-10.75}" --warmup-minutes 0.5 --profile-steps 4 \
  --variants "$flex" --out $T/long > $T/long_log.txt 2>&1
python3 train_bench.py --shape 27b --tokens "${T3_27B_TOKENS:-300000}" --work /tmp/dflash-train-bench-27b --minutes "${T3_LEVER_MIN:-1.25}" \
  --warmup-minutes 0.5 --profile-steps 4 --variants "${T3_27B_VARIANTS:-${flex:-defaults};anchors_per_sample=1024${flex:+,$flex}}" \
  --out $T/27b \
  > $T/27b_log.txt 2>&1
touch $T/done
