#!/usr/bin/env bash
# Issues 28 and 29 in one detached chain on one GPU (bench/device.sh realtext-all starts it, realtext-wait waits):
#   1. the real-text target (train_target.py, RT_MINUTES), its chat data;
#   2. the pipeline up to a validated store (regenerate RT_SAMPLES conversations, prepare, probe, extract, validate);
#   3. side by side on the same GPU (RT_MAIN=0: the precision runs alone):
#      - the drafter trained RT_TRAIN_MINUTES and evaluated, then the agreement ceiling (agreement.py);
#      - with RT_PRECISION=1: a store per compact precision and its error, then a drafter per (seed in
#        RT_PREC_SEEDS, precision), RT_PREC_STEPS steps each, evaluated on RT_PREC_PROMPTS prompts (precision.py;
#        one process each, all at once, each its own DFLASH_LOCK_DIR: they share the GPU on purpose);
#      - with RT_LEVERS=1: a drafter per (seed in RT_LEVER_SEEDS, variant in RT_LEVER_VARIANTS), as many samples as
#        RT_LEVER_STEPS baseline steps, side by side in the same way (levers.py);
#      - then, with RT_SPECULATORS=1: speculators' DFlash trainer with its own defaults on the same store (export-states;
#        it needs layers.capture_last=true in RT_SET), the same samples, one process per seed in RT_LEVER_SEEDS side by
#        side, each result converted (import-drafter) and scored on the same prompts by our decoder and z-lab's
#        (speculators_run.py; its rows join levers.py's table as variant `speculators`; RT_SPEC_TRAINER_ARGS: more flags
#        for its trainer).
# Logs and reports under /tmp/rt; /tmp/rt/done when everything ended. Run from the repository root.
set -x
echo $$ > /tmp/rt/pid  # realtext-wait waits on this process (device.sh writes it too)
# RT_SET: more overrides for every run, e.g. a CPU rehearsal's "--set regenerate.max_new_tokens=24 ..."
samples="--set data.max_samples=${RT_SAMPLES:-1792} ${RT_SET:-}"
# RT_REUSE=1: keep the target and store of an earlier chain on this machine (a later block alone, e.g. RT_SPECULATORS=1
# again; a new target would make the store refuse its states)
if [[ ${RT_REUSE:-0} != 1 ]]; then
(cd bench && python3 realtext/train_target.py --out ../runs/realtext --minutes "${RT_MINUTES:-4.0}" ${RT_TARGET_ARGS:-}) \
  > /tmp/rt/target_log.txt 2>&1
python3 bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 99999 $samples \
  --stages regenerate,prepare,probe,extract,validate --report /tmp/rt/store_report.json > /tmp/rt/store_log.txt 2>&1 \
  || { echo "the store pipeline failed: /tmp/rt/store_log.txt"; exit 1; }  # nothing after it has data to work on
fi
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
  # One process per compact store, then one per (seed, precision), all side by side: a drafter this small leaves
  # the GPU mostly idle and its steps are bound by the host, so 12 processes on 16 cores finish ~12 runs in the
  # time of a few (each its own DFLASH_LOCK_DIR; 2 threads each, not 16)
  export OMP_NUM_THREADS=${RT_PREC_THREADS:-2}
  # Each run resumes the (finished) regeneration first, and a regeneration takes one writer at a time: a run that
  # finds another one there tries again a few seconds later
  stores() {
    for attempt in 1 2 3 4 5 6; do
      DFLASH_LOCK_DIR=/tmp/rt-locks-stores-$1 python3 bench/realtext/precision.py stores "${prec[@]}" --precisions $1 \
        > /tmp/rt/precision_stores_$1_log.txt 2>&1 && return 0
      grep -q "another process is regenerating" /tmp/rt/precision_stores_$1_log.txt || return 1
      sleep $((2 + RANDOM % 5))
    done
    return 1
  }
  pids=()
  # RT_PRECISIONS: the compact precisions to measure beside full (e.g. "int8" alone after a change to it)
  for p in ${RT_PRECISIONS:-fp8 int8 int4}; do stores $p & pids+=($!); done
  wait "${pids[@]}"
  pids=()
  for s in ${RT_PREC_SEEDS:-0 1 2}; do
    for p in full ${RT_PRECISIONS:-fp8 int8 int4}; do
      DFLASH_LOCK_DIR=/tmp/rt-locks-$s-$p python3 bench/realtext/precision.py train "${prec[@]}" --precisions $p \
        --set regenerate.enabled=false --seed $s --steps "${RT_PREC_STEPS:-1000}" \
        > /tmp/rt/precision_seed${s}_${p}_log.txt 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  unset OMP_NUM_THREADS
  python3 bench/realtext/precision.py report "${prec[@]}" > /tmp/rt/precision_table.txt 2>&1
  cp runs/realtext/precision/precision.json /tmp/rt/ || true
fi
# RT_LEVERS=1: the recipe's levers one at a time (bench/realtext/levers.py), one process per (seed, variant), side by
# side like the precision runs; the store needs the target's last hidden state for `distill`, so the chain's first
# run takes RT_SET="--set layers.capture_last=true"
if [[ ${RT_LEVERS:-0} == 1 ]]; then
  lv=(--out runs/realtext/levers $samples --set "evaluate.num_prompts=${RT_PREC_PROMPTS:-30}" ${RT_LEVER_ARGS:-})
  export OMP_NUM_THREADS=${RT_PREC_THREADS:-2}
  pids=()
  for s in ${RT_LEVER_SEEDS:-0 1 2}; do
    for v in ${RT_LEVER_VARIANTS:-baseline dpace muon distill}; do
      DFLASH_LOCK_DIR=/tmp/rt-locks-lv-$s-$v python3 bench/realtext/levers.py train "${lv[@]}" --variants $v \
        --set regenerate.enabled=false --seed $s --steps "${RT_LEVER_STEPS:-2000}" \
        > /tmp/rt/levers_seed${s}_${v}_log.txt 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  unset OMP_NUM_THREADS
  python3 bench/realtext/levers.py report "${lv[@]}" > /tmp/rt/levers_table.txt 2>&1
  cp runs/realtext/levers/levers.json /tmp/rt/ || true
fi
# RT_SPECULATORS=1: speculators' trainer beside ours (issue 48 item 2; bench/realtext/speculators_run.py, docs/INTEROP.md)
if [[ ${RT_SPECULATORS:-0} == 1 ]]; then
  sp=(--out runs/realtext/levers $samples --set "evaluate.num_prompts=${RT_PREC_PROMPTS:-30}" --steps "${RT_LEVER_STEPS:-2000}")
  if python3 bench/realtext/speculators_run.py prepare "${sp[@]}" > /tmp/rt/speculators_prepare_log.txt 2>&1; then
    export OMP_NUM_THREADS=${RT_PREC_THREADS:-2}
    pids=()
    for s in ${RT_LEVER_SEEDS:-0 1 2}; do
      DFLASH_LOCK_DIR=/tmp/rt-locks-sp-$s python3 bench/realtext/speculators_run.py seed "${sp[@]}" --seed $s \
        --spec-args "${RT_SPEC_TRAINER_ARGS:-}" > /tmp/rt/speculators_seed${s}_log.txt 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    unset OMP_NUM_THREADS
  fi
  python3 bench/realtext/levers.py report --out runs/realtext/levers > /tmp/rt/levers_table.txt 2>&1
  cp runs/realtext/levers/levers.json /tmp/rt/ || true
fi
wait $main
touch /tmp/rt/done
