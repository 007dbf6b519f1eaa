#!/usr/bin/env bash
# The GPU benchmarks, rerunnable by anyone (bench/RESULTS.md records what each gave).
#
#   bench/device.sh wheels            here (a machine with PyPI): the wheels the GPU host lacks, into .whl/
#   bench/device.sh STEP [STEP ...]   on the GPU host, from the repository root: installs .whl/ and this package
#                                     into /tmp/site, then runs each STEP, results under $OUT (default bench-out/)
#
# STEPs: extract (8B extraction, 2M tokens, a kernel profile of (a); bench/extract_bench.py), hybrid (27B: the
# Gated DeltaNet forward and compile variants of (a), the pipeline (b), a kernel profile; HYBRID_TOKENS,
# HYBRID_VARIANTS, GDN_FORWARD), train (drafter training variants, short), train-long (12 minutes of training,
# detached; then `collect` in a later call), resume (GPU kill-and-resume bit-identity), scaling (every visible GPU:
# extraction and DDP training), conv (the hybrid kernels' error per layer against float32: fla's convolution, the
# fused GDN forward), disk (write the fresh disk once before measuring the pipeline: `bash bench/device.sh disk
# extract`), extract-int4 (issue 29: the 8B pipeline at the precision the disk check recommends, then int4,
# fp8, full), quant (each compact precision's quantization time per batch against the forward; bench/quant_bench.py),
# fp8 (issue 31: extraction from the target in bf16, then the same weights in block-wise FP8; FP8_SHAPES, FP8_TOKENS,
# FP8_TARGETS, FP8_PROFILE=N profiles N batches of (a), FP8_ARGS more extract_bench.py options),
# fp8-equality (issue 31: the FP8 states per layer against the emulation, transformers' dequantized forward, bf16),
# train-precision (issue 29: training from a store of each TRAIN_PRECISIONS, default full and int4), flex (issue 30:
# the drafter's attention, forward + backward, per FlexAttention tile setting and query-group count; bench/flex_tune.py),
# train3 / train3-wait (issue 30: bench/train3_chain.sh, detached), realtext-target / realtext-pipeline / realtext-resume (issue 28, bench/realtext/: train the real-text
# target, build its chat data, then the pipeline on it; the wheels: `WHEEL_DIR=runs/realtext-whl bench/device.sh
# wheels realtext`, the calls `WHEEL_DIR=runs/realtext-whl bash bench/device.sh realtext-target`, carry=["runs/realtext-whl"]).
# A GPU host without PyPI: copy .whl/ (git-ignored) there with the checkout, then e.g. `bash bench/device.sh extract train`.
set -euo pipefail
WHEELS=(zarr==3.1.6 donfig==0.8.1.post1 numcodecs==0.16.6 google-crc32c==1.9.0 pydantic==2.14.4
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tenacity==9.2.1 fla-core==0.6.0)
# `datasets` and what it needs beyond the image: the benches publish their stores with a prepared dataset beside
# them (common.publish_store), and bench/realtext/pipeline.py runs the prepare stage on the GPU host.
DATASETS_WHEELS=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0)
WHEELS+=("${DATASETS_WHEELS[@]}")
# speculators' DFlash trainer and z-lab's reference decoder (issue 48, bench/realtext/speculators_run.py, chain.sh's
# RT_SPECULATORS=1; docs/INTEROP.md), without their pins (they clash with the image's), and what they import that the
# image lacks: openai 2.x (on httpx, which the image has; 3.x needs httpx2), loguru, pydantic-settings
SPECULATORS_WHEELS=(speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0 loguru==0.7.3 openai==2.54.0 distro==1.9.0
                    jiter==0.19.0 sniffio==1.3.1 pydantic-settings==2.16.3 python-dotenv==1.2.4)
WHEEL_DIR=${WHEEL_DIR:-.whl}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"

if [[ ${1:-} == wheels ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  # realtext: no fla-core (the real-text runs use transformers' own Gated DeltaNet: no Triton warm-up)
  [[ ${2:-} == realtext ]] && WHEELS=("${WHEELS[@]/fla-core==*/}" "${SPECULATORS_WHEELS[@]}")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEEL_DIR" ${WHEELS[@]}
  ls "$WHEEL_DIR"
  exit 0
fi

# SKIP_INSTALL=1: a later step on a machine whose detached work (train-long, realtext-all) still imports from
# /tmp/site must not have the package rewritten under it.
if [[ -z ${SKIP_INSTALL:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
cd bench
for step in "$@"; do
  echo "=== $step $(date -u +%FT%TZ)"
  case $step in
    extract) python3 extract_bench.py --shapes 8b --tokens 2000000 --no-save --skip-naive \
               --writer-gib 0 --profile-a 2 --out "$OUT" 2>&1 | tee "$OUT/extract_log.txt" ;;
    hybrid) python3 extract_bench.py --shapes 27b --tokens-27b "${HYBRID_TOKENS:-200000}" --no-save --skip-naive \
              --writer-gib 0 --gdn-forward "${GDN_FORWARD:-auto}" --profile-a 2 --out "$OUT" \
              --a-variants "${HYBRID_VARIANTS-gdn=transformers,compile=norms;gdn=fused,compile=norms}" 2>&1 \
              | tee "$OUT/hybrid_log.txt" ;;
    train) python3 train_bench.py --minutes 2 --warmup-minutes 0.75 --profile-steps 4 \
             --variants "${TRAIN_VARIANTS:-defaults;compile=off}" --out "$OUT" 2>&1 | tee "$OUT/train_log.txt" ;;
    # Issue 29 item 4: the drafter's training from a store of each precision (TRAIN_PRECISIONS), same variant and
    # minutes (TRAIN_MIN), one target and store per precision (its work dir deleted after: the 8B checkpoint is 16 GB)
    train-precision) for p in ${TRAIN_PRECISIONS:-full int4}; do
                       python3 train_bench.py --precision "$p" --minutes "${TRAIN_MIN:-2}" --warmup-minutes 0.75 \
                         --work "/tmp/tb-$p" --out "$OUT/train-$p" 2>&1 | tee "$OUT/train-${p}_log.txt"
                       rm -rf "/tmp/tb-$p"
                     done ;;
    # 12 minutes (a window of >= 10 after 1 of warm-up and the stop): started detached (setsid outlives the shell that
    # started it), then `collect`, run later on the same machine, waits for it by its pid.
    train-long) mkdir -p /tmp/train-long
                setsid nohup python3 train_bench.py --reuse --minutes 12 --warmup-minutes 1 --profile-steps 4 \
                  --out /tmp/train-long > /tmp/train-long/log.txt 2>&1 < /dev/null &
                echo $! > /tmp/train-long/pid; echo "started, pid $(cat /tmp/train-long/pid)" ;;
    collect) while kill -0 "$(cat /tmp/train-long/pid)" 2>/dev/null; do sleep 5; done
             cp /tmp/train-long/* "$OUT/"; tail -4 "$OUT/log.txt" ;;
    resume) python3 gpu_resume_bench.py --out "$OUT/resume" --tokens 200000 --kill-after-shard 40 2>&1 \
              | tee "$OUT/resume_log.txt" ;;
    scaling) python3 multi_gpu_bench.py --out "$OUT" --train-steps 200 2>&1 | tee "$OUT/scaling_log.txt" ;;
    # A fresh VM disk writes its first blocks slowly (2026-12-01: 8-9 s of writer wait in the first 8B run, 0.35 s
    # once ~60 GB had been written; bench/RESULTS.md, "Fresh disks and the disk check"): fill most of the free disk
    # once before measuring the pipeline, then delete.
    disk) free=$(df --output=avail -B1G /tmp | tail -1); n=$(( free > 6 ? (free - 6) * 64 : 0 ))
          dd if=/dev/zero of=/tmp/disk-warm bs=16M count=$n oflag=direct 2>&1 | tail -1 | tee "$OUT/disk.txt"
          rm -f /tmp/disk-warm ;;
    # Issue 29: the 8B pipeline with the precision the disk check recommends (on a fresh disk: run it first), then
    # the other precisions on the same (by then written) disk (INT4_VARIANTS; INT4_VARIANTS= for none)
    extract-int4) python3 extract_bench.py --shapes 8b --tokens "${INT4_TOKENS:-1000000}" --no-save --skip-naive \
                    --writer-gib 0 --disk-check-mib 4096 --store-precision recommend \
                    --b-variants "${INT4_VARIANTS-store_precision=int4;store_precision=fp8;store_precision=full}" \
                    --out "$OUT/int4" 2>&1 | tee "$OUT/int4_log.txt" ;;
    quant) python3 quant_bench.py --out "$OUT" 2>&1 | tee "$OUT/quant_log.txt" ;;
    # Issue 31: the same random-weight shape as bf16, then quantized to block-wise FP8 in memory (FP8_SHAPES)
    fp8) for t in ${FP8_TARGETS:-bf16 fp8}; do
           python3 extract_bench.py --shapes "$(echo ${FP8_SHAPES:-27b} | tr ' ' ,)" --tokens-27b "${FP8_TOKENS:-200000}" --no-save \
             --skip-naive --writer-gib 0 $([[ $t == fp8 ]] && echo --target-fp8) --profile-a "${FP8_PROFILE:-0}" ${FP8_ARGS:-} \
             --out "$OUT/fp8-$t" 2>&1 \
             | tee "$OUT/fp8-${t}_log.txt"
         done ;;
    # Issue 31: the FP8 forward's stored states per layer against the emulation, transformers' dequantized forward
    # and the bf16 source model (bench/fp8_equality.py; FP8_SHAPES)
    fp8-equality) for s in ${FP8_SHAPES:-27b}; do python3 fp8_equality.py --shape "$s" --out "$OUT" 2>&1 \
                    | tee "$OUT/fp8_equality_${s}_log.txt"; done ;;
    flex) python3 flex_tune.py --out "$OUT/flex" 2>&1 | tee "$OUT/flex_log.txt" ;;
    conv) python3 conv_kernel_check.py --out "$OUT" 2>&1 | tee "$OUT/conv_log.txt" ;;
    # Issue 28. Under ../runs/realtext (on the GPU host's disk: run the three steps on the same machine).
    realtext-target) python3 realtext/train_target.py --out ../runs/realtext --minutes "${RT_MINUTES:-6}" \
                       --deadline-s "${RT_DEADLINE:-520}" 2>&1 | tee "$OUT/target_log.txt"
                     cp ../runs/realtext/target_report.json ../runs/realtext/chat/chat_stats.json "$OUT/" ;;
    realtext-pipeline | realtext-resume)
      stages=""; [[ $step == realtext-resume ]] && stages="--stages probe,train,evaluate"
      (cd .. && python3 bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s "${RT_DEADLINE:-540}" \
         --eval-reserve-s "${RT_EVAL_RESERVE:-150}" $stages ${RT_ARGS:-} --report "$OUT/pipeline_report.json" 2>&1 \
         | tee "$OUT/${step}_log.txt")
      cp ../runs/realtext/pipeline/drafter/metrics.json "$OUT/drafter_metrics.json" 2>/dev/null || true ;;
    # Issues 28 and 29 in one detached chain (bench/realtext/chain.sh: the target, the pipeline, the precision table
    # beside its training; RT_* settings there). It runs detached; `realtext-wait`, run later on the same machine,
    # waits for it, up to RT_WAIT seconds, and packs what it wrote into $OUT/rt.tar.gz.
    realtext-all)
      mkdir -p /tmp/rt; rm -f /tmp/rt/done
      # (the `&` on setsid alone: on `cd .. && setsid ...` it backgrounded a subshell, the pid file named that
      # subshell, gone once setsid ran, and a later realtext-wait took the running chain for dead)
      (cd .. && { setsid nohup bash bench/realtext/chain.sh > /tmp/rt/chain_log.txt 2>&1 < /dev/null &
                  echo $! > /tmp/rt/pid; })
      echo "started, pid $(cat /tmp/rt/pid)" ;;
    realtext-wait)
      # A machine other than the one that ran realtext-all has no chain: say so at once
      if [[ ! -e /tmp/rt/pid ]]; then
        echo "realtext-wait: no realtext-all chain on this machine (/tmp/rt/pid missing: it ran on another" \
             "machine, or this one was restarted); start again with realtext-all" >&2; exit 3
      fi
      end=$(( $(date +%s) + ${RT_WAIT:-560} ))
      while [[ ! -e /tmp/rt/done && $(date +%s) -lt $end ]] && kill -0 "$(cat /tmp/rt/pid)" 2>/dev/null; do
        sleep 10; done
      if [[ -e /tmp/rt/done ]]; then echo "chain done"
      elif kill -0 "$(cat /tmp/rt/pid)" 2>/dev/null; then echo "chain still running"
      else echo "chain ended without finishing: see chain_log.txt and the stage logs"; fi
      # One archive: a copy-back that takes a few files at a time then loses none of them (a pipeline report was lost so)
      rm -rf /tmp/rt-out; mkdir -p /tmp/rt-out; cp -r /tmp/rt/. /tmp/rt-out/
      cp ../runs/realtext/target_report.json ../runs/realtext/chat/chat_stats.json /tmp/rt-out/ 2>/dev/null || true
      d=../runs/realtext/pipeline/drafter; cp "$d/metrics.json" "$d"/export/*.json "$d"/*.png /tmp/rt-out/ 2>/dev/null || true
      # the precision runs' figures as they land (errors, rows, each drafter's loss history): a chain cut short still
      # brings back what it finished (one cut short lost its 12 trained runs' losses before this)
      p=../runs/realtext/precision; cp "$p"/*.json "$p"/*.jsonl /tmp/rt-out/ 2>/dev/null || true
      for m in "$p"/drafter-*/metrics.json; do [[ -e $m ]] && cp "$m" "/tmp/rt-out/metrics-$(basename "$(dirname "$m")").json"; done
      # the levers' rows and loss histories likewise (RT_LEVERS=1)
      l=../runs/realtext/levers; cp "$l"/*.json "$l"/*.jsonl /tmp/rt-out/ 2>/dev/null || true
      for m in "$l"/drafter-*/metrics.json; do [[ -e $m ]] && cp "$m" "/tmp/rt-out/levers-$(basename "$(dirname "$m")").json"; done
      # speculators' trainer (RT_SPECULATORS=1): its logs and resolved config per seed, each converted drafter's figures
      for d in "$l"/speculators-seed*/; do [[ -d $d ]] || continue; n=$(basename "$d")
        cp "$d/train_log.txt" "/tmp/rt-out/${n}_train_log.txt" 2>/dev/null || true
        cp "$d/run.yaml" "/tmp/rt-out/${n}_run.yaml" 2>/dev/null || true; done
      for m in "$l"/drafter-speculators-seed*/export/dflash_meta.json; do
        [[ -e $m ]] && cp "$m" "/tmp/rt-out/meta-$(basename "$(dirname "$(dirname "$m")")").json" || true; done
      tar -czf "$OUT/rt.tar.gz" -C /tmp/rt-out . && echo "results: rt.tar.gz ($(ls /tmp/rt-out | wc -l) files)"
      # (set -e: a log the chain has not reached yet must not fail the step, as it once did: rc 1)
      for f in target_log:5 store_log:3 pipeline_log:12 precision_table:30 levers_table:14 agreement_log:3 \
               speculators_prepare_log:2 speculators_seed0_log:2 speculators_seed1_log:2 speculators_seed2_log:2; do tail -"${f#*:}" "/tmp/rt/${f%:*}.txt" 2>/dev/null || true; done ;;
    # Issue 30 in one detached chain (bench/train3_chain.sh: query groups and packing against the defaults, ten minutes
    # of the fastest, the 27B-shape drafter; T3_BUDGET_S: a deadline in seconds from its start);
    # `train3-wait`, run later on the same machine (SKIP_INSTALL=1), waits up to T3_WAIT s and packs /tmp/t3 into
    # $OUT/t3.tar.gz.
    train3) rm -rf /tmp/t3; mkdir -p /tmp/t3  # (a machine can come back with an earlier chain's /tmp/t3 in it)
            setsid nohup bash train3_chain.sh > /tmp/t3/chain_log.txt 2>&1 < /dev/null &
            echo $! > /tmp/t3/pid; echo "started, pid $(cat /tmp/t3/pid)" ;;
    train3-wait)
      [[ -e /tmp/t3/pid ]] || { echo "train3-wait: no train3 chain on this machine (it ran on another one?)" >&2; exit 3; }
      [[ -n ${T3_LEFT_S:-} ]] && echo $(( $(date +%s) + T3_LEFT_S )) > /tmp/t3/end  # a new deadline, N s from now
      end=$(( $(date +%s) + ${T3_WAIT:-560} ))
      while [[ ! -e /tmp/t3/done && $(date +%s) -lt $end ]] && kill -0 "$(cat /tmp/t3/pid)" 2>/dev/null; do sleep 10; done
      [[ -e /tmp/t3/done ]] && echo "chain done" || echo "chain still running (or ended early: see chain_log.txt)"
      tar -czf "$OUT/t3.tar.gz" -C /tmp/t3 . && echo "results: t3.tar.gz"
      for f in flex_log:6 levers_log:8 best:3 long_log:4 27b_log:4; do tail -"${f#*:}" "/tmp/t3/${f%:*}.txt" 2>/dev/null || true; done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
