#!/usr/bin/env bash
# Issue 30 on one GPU, detached (bench/device.sh train3 starts it, train3-wait waits); run from bench/, results under
# /tmp/t3, /tmp/t3/done at the end:
#   1. (T3_FLEX=1) flex_tune.py: the drafter's attention alone (8B shape), the default tiles against query groups
#      (train.attention_groups); T3_LEVER_VARIANTS may name the fastest count as {G} (attention_groups={G});
#   2. the levers in training (train_bench.py, 8B shape): the defaults against packing 4 and 6 samples per step
#      (2026-12-06, bench/RESULTS.md "Training": packing 4 was the fastest, query groups cost more than they saved);
#   3. the fastest lever (by MFU) for ten minutes after warm-up (T3_LONG_MIN, cut to what T3_BUDGET_S leaves), and
#   4. the 27B-shape drafter with the fastest lever (batch 1 if that fails), if the budget leaves T3_27B_NEED_S;
#      3 first where the levers reached T3_GOAL (0.60), else 4 first.
# T3_BUDGET_S: seconds from the chain's start by which it must end (the time the machine is yours; 0 = none; a later
# `T3_LEFT_S=N bash bench/device.sh train3-wait` resets it to N s from then). Other knobs:
# T3_FLEX=1, T3_FLEX_SHAPES (8b; 27b for head dimension 256), T3_FLEX_CONFIGS (default: the default's tiles against
# query groups; `all`: every configuration of flex_tune.py), T3_FLEX_CTX, T3_GROUPS, T3_REUSE=1, T3_LEVERS=0,
# T3_BEST (the lever without measuring the levers), T3_LEVER_VARIANTS, T3_LEVER_MIN, T3_LONG=0, T3_LONG_TOKENS (the
# 8B store's size where none is reused), T3_27B=0, T3_27B_TOKENS, T3_27B_VARIANTS ({G}: the fastest query-group
# count of T3_FLEX=1, {FLEX}: its fastest tile configuration, as train_bench's flex=PATH).
set -x
T=/tmp/t3
echo $$ > $T/pid
# $T/end: the epoch second by which the chain must end, from T3_BUDGET_S here or T3_LEFT_S of a later train3-wait
budget=${T3_BUDGET_S:-0}
(( budget > 0 )) && echo $(( $(date +%s) + budget )) > $T/end
left() { if [[ -s $T/end ]]; then echo $(( $(cat $T/end) - $(date +%s) )); else echo 999999; fi; }
configs=default; for g in ${T3_GROUPS:-4 8 16}; do configs+=",groups-$g"; done
fc=${T3_FLEX_CONFIGS:-$configs}; [[ $fc == all ]] && fc=""  # ("" = every configuration of flex_tune.py)
[[ ${T3_FLEX:-0} == 0 ]] || python3 flex_tune.py --shapes "${T3_FLEX_SHAPES:-8b}" --ctx "${T3_FLEX_CTX:-900}" \
  --configs "$fc" --out $T/flex > $T/flex_log.txt 2>&1
G=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['attention_groups'])" $T/flex/groups_best.json \
  2>/dev/null || echo 8)
[[ $G == 1 ]] && G=8  # (the default's tiles won alone: still measure a grouped layout in training, where it may differ)
reuse=""; [[ ${T3_REUSE:-0} == 1 ]] && reuse=--reuse  # (the 8B store of an earlier chain on this machine)
variants=${T3_LEVER_VARIANTS:-defaults;pack=true,batch_size=4;pack=true,batch_size=6}
[[ ${T3_LEVERS:-1} == 0 || -n ${T3_BEST+x} ]] || python3 train_bench.py $reuse --minutes "${T3_LEVER_MIN:-1.2}" --warmup-minutes 0.5 --profile-steps 4 \
  --variants "${variants//\{G\}/$G}" --out $T/levers > $T/levers_log.txt 2>&1
# the fastest lever's overrides as a variant ("" = the defaults) and its MFU; failed variants are skipped
read -r best_mfu best < <(python3 -c "
import json, sys
v = [r for r in json.load(open(sys.argv[1]))['variants'] if 'mfu' in r]
b = max(v, key=lambda r: r['mfu'])
print(round(b['mfu'], 4), ','.join(f'{k}={x if isinstance(x, str) else json.dumps(x)}' for k, x in b['overrides'].items()))
" $T/levers/train_bench.json 2>/dev/null || echo 0)
[[ -n ${T3_BEST+x} ]] && best=$T3_BEST best_mfu=0  # a lever named, not measured here ("" = the defaults)
echo "fastest lever: ${best:-defaults} (MFU ${best_mfu:-0})" > $T/best.txt

run27b() {  # the 27B-shape drafter: the fastest lever, and batch 1 if that did not fit
  if [[ ${T3_27B:-1} == 0 ]] || (( $(left) < ${T3_27B_NEED_S:-270} )); then
    echo "27B-shape drafter skipped: $(left) s of the budget left" >> $T/best.txt; return
  fi
  one() { python3 train_bench.py --shape 27b --tokens "${T3_27B_TOKENS:-200000}" --work /tmp/dflash-train-bench-27b \
    --minutes "${T3_LEVER_MIN:-1.2}" --warmup-minutes 0.5 --profile-steps 4 --variants "$1" --out "$2" $3 > "$2_log.txt" 2>&1; }
  v27=${T3_27B_VARIANTS:-$best}; v27=${v27//\{G\}/$G}
  one "${v27//\{FLEX\}/$T/flex/flex_best.json}" $T/27b
  python3 -c "import json, sys; assert any('mfu' in r for r in json.load(open(sys.argv[1]))['variants'])" \
    $T/27b/train_bench.json 2>/dev/null || one "" $T/27b-batch1 --reuse
}
run_long() {  # the fastest lever for T3_LONG_MIN, or what the budget leaves less ~75 s for the run's start and end
  # (11.3 minutes: the window after warm-up is ~50 s shorter than the run: a 10.6-minute run gave 9.6 minutes)
  [[ ${T3_LONG:-1} == 0 ]] && return
  long=$(python3 -c "import sys; print(round(min(float(sys.argv[1]), (int(sys.argv[2]) - 75) / 60), 2))" \
    "${T3_LONG_MIN:-11.3}" "$(left)")
  echo "long run: $long minutes" >> $T/best.txt
  python3 train_bench.py --reuse --tokens "${T3_LONG_TOKENS:-400000}" --minutes "$long" --warmup-minutes 0.5 \
    --profile-steps 4 --variants "$best" --out $T/long > $T/long_log.txt 2>&1
}
# The order decides what a short budget (or a machine taken back) loses: with the goal's MFU (0.60) reached the
# ten-minute run that shows it holds comes first; short of it, the 27B-shape drafter, never measured, does.
if python3 -c "import sys; sys.exit(float(sys.argv[1]) < ${T3_GOAL:-0.60})" "${best_mfu:-0}"; then
  run_long; run27b
else
  run27b; run_long
fi
touch $T/done
