#!/usr/bin/env bash
# Issues 28 and 29 in one detached chain on one GPU (bench/device.sh realtext-all starts it, realtext-wait waits):
#   1. the real-text target (train_target.py, RT_MINUTES), its chat data;
#   2. the pipeline up to a validated store (regenerate RT_SAMPLES conversations, prepare, probe, extract, validate);
#   3. side by side on the same GPU (RT_MAIN=0: the precision runs alone):
#      - the drafter trained RT_TRAIN_MINUTES and evaluated, then the agreement ceiling (agreement.py);
#      - with RT_PRECISION=1: a store per compact precision and its error, then one process per seed training a
#        drafter per precision (RT_PREC_STEPS steps, RT_PREC_PROMPTS prompts), none started after RT_PREC_UNTIL_S
#        from the chain's start (precision.py; each process its own DFLASH_LOCK_DIR: they share the GPU on purpose).
# Logs and reports under /tmp/rt; /tmp/rt/done when everything ended. Run from the repository root.
set -x
echo $$ > /tmp/rt/pid  # realtext-wait waits on this process (device.sh writes it too)
start=$(date +%s)
# RT_SET: more overrides for every run, e.g. a CPU rehearsal's "--set regenerate.max_new_tokens=24 ..."
samples="--set data.max_samples=${RT_SAMPLES:-1792} ${RT_SET:-}"
(cd bench && python3 realtext/train_target.py --out ../runs/realtext --minutes "${RT_MINUTES:-4.0}" ${RT_TARGET_ARGS:-}) \
  > /tmp/rt/target_log.txt 2>&1
python3 bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 99999 $samples \
  --stages regenerate,prepare,probe,extract,validate --report /tmp/rt/store_report.json > /tmp/rt/store_log.txt 2>&1
# RT_MAIN=0: the precision table alone (no 10-minute drafter, no agreement): the precision runs get the GPU
[[ ${RT_MAIN:-1} == 1 ]] && (
  python3 bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 99999 $samples \
    --set regenerate.enabled=false --stages train,evaluate --train-minutes "${RT_TRAIN_MINUTES:-10.05}" \
    --report /tmp/rt/pipeline_report.json > /tmp/rt/pipeline_log.txt 2>&1
  python3 bench/realtext/agreement.py --target runs/realtext/target --store runs/realtext/pipeline/store \
    --heldout runs/realtext/chat/heldout_prompts.jsonl --out /tmp/rt/agreement.json > /tmp/rt/agreement_log.txt 2>&1
) &
main=$!
if [[ ${RT_PRECISION:-1} == 1 ]]; then
  prec=(--out runs/realtext/precision $samples --set "evaluate.num_prompts=${RT_PREC_PROMPTS:-15}" ${RT_PREC_ARGS:-})
  DFLASH_LOCK_DIR=/tmp/rt-locks-stores python3 bench/realtext/precision.py stores "${prec[@]}" \
    > /tmp/rt/precision_stores_log.txt 2>&1
  seeds=()
  for s in 0 1 2; do
    DFLASH_LOCK_DIR=/tmp/rt-locks-$s python3 bench/realtext/precision.py train "${prec[@]}" \
      --set regenerate.enabled=false --seed $s --steps "${RT_PREC_STEPS:-1000}" \
      --until $((start + ${RT_PREC_UNTIL_S:-1380})) > /tmp/rt/precision_seed${s}_log.txt 2>&1 &
    seeds+=($!)
  done
  wait "${seeds[@]}"
  python3 bench/realtext/precision.py report "${prec[@]}" > /tmp/rt/precision_table.txt 2>&1
  cp runs/realtext/precision/precision.json /tmp/rt/ || true
fi
wait $main
touch /tmp/rt/done
