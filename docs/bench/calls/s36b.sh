#!/bin/bash
# Session 36, call 2 (issue 17): kda_products.sh from the branch wip/kda-intra-solve, whose tree travels as _kda/
# (git archive wip/kda-intra-solve | tar -x -C _kda; not committed).
cd _kda && bash docs/bench/calls/kda_products.sh
