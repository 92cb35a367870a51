#!/bin/bash
# Session 36 (issue 18): dplr_products.sh from the branch wip/kda-intra-solve, whose tree travels as _kda/.
cd _kda && bash docs/bench/calls/dplr_products.sh
