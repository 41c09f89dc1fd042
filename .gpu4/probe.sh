#!/usr/bin/env bash
# After each recipe variant finishes: by-position eval and passkey, then bundle the results.
. /root/env.sh
cd /root
mkdir -p /root/out
for m in "$@"; do
  while pgrep -f "runs/$m( |$)" > /dev/null; do sleep 5; done
  echo "## $m finished $(date +%T)"; tail -c 3000 /root/$m.log | tr '\r' '\n' | grep -v "it/s\|step/s" | tail -40
  python3 -m glaswap.cli eval /root/runs/$m --text /root/texts/jargon.txt /root/texts/paradiselost.txt \
    --context 2048 --by-position --first-bin 2048 --max-tokens 131072 --batch-size 8 --out /root/out/$m-eval 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it"
  tflag=""; [ "$m" = A ] || tflag="--no-teacher"
  python3 -m glaswap.cli passkey /root/runs/$m --lengths 1K,2K,4K,8K,16K,32K --trials 2 $tflag --out /root/out/$m-pk 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it"
  cp /root/$m.log /root/out/$m.log; cp /root/runs/$m/*.json /root/runs/$m/*.png /root/out/ 2>/dev/null; mkdir -p /root/out/$m-run; cp /root/runs/$m/*.json /root/runs/$m/*.png /root/out/$m-run/ 2>/dev/null
  echo "## $m probed $(date +%T)"
done
tar czf /root/results.tar.gz -C /root out && echo ALLDONE
