#!/usr/bin/env bash
# Trainer img/s: session-start commit (.base, no install) vs HEAD snapshot (.snap), same H100, real CIFAR-10 shards.
set -u
R=$(pwd); export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/env.txt
NOEVAL="--set eval.probe=false --set eval.knn=false --set eval.effective_rank=false --set eval.recon=false --set log.progress=false --set log.tensorboard=false --set ckpt.every=0"
run() { tag=$1; dir=$2; t=$3; shift 3; (cd $R/$dir && timeout $t python3 -m dres.train.cli "$@" $NOEVAL --out /tmp/$tag > $OUT/$tag.log 2>&1); echo "exit $? $tag"; python3 $R/.dev/rate.py $tag /tmp/$tag; }
export PYTHONPATH=$R/.base
run base_mae1024 .base 100 mae --preset mae_cifar10 --set batch_size=1024 --set steps=200 --set log.every=20
run base_mae256 .base 80 mae --preset mae_cifar10 --set batch_size=256 --set steps=300 --set log.every=30
run base_uvit128 .base 90 uvit --preset uvit_cifar10 --set steps=400 --set log.every=40 --set eval.n_samples=8
run base_cls256 .base 90 classify --preset classify_cifar10 --set steps=400 --set log.every=40
unset PYTHONPATH
cd $R/.snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { echo install failed; tail $OUT/install.log; }
python3 -c "import dres; print('dres path', dres.__path__)"
cd $R
run new_mae1024_graph .snap 90 mae --preset mae_cifar10 --set batch_size=1024 --set steps=400 --set log.every=40
run new_mae1024_eager .snap 90 mae --preset mae_cifar10 --set batch_size=1024 --set steps=200 --set log.every=20 --set cuda_graphs=false
run new_mae256_graph .snap 80 mae --preset mae_cifar10 --set batch_size=256 --set steps=600 --set log.every=60
run new_uvit128_graph .snap 90 uvit --preset uvit_cifar10 --set steps=600 --set log.every=60 --set eval.n_samples=8
run new_cls256_graph .snap 90 classify --preset classify_cifar10 --set steps=600 --set log.every=60
grep RATE -h $OUT/*.log >/dev/null; echo done
