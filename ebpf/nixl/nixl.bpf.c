/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NIXL probes as one BPF object (they share maps): agent identity, the transfer
 * lifecycle, and metadata / notification / memory calls. Built by agent/build.rs with
 * clang -target bpf; loaded and attached by agent/src/nixl/.
 */
#include "agent.bpf.c"
#include "xfer.bpf.c"
#include "calls.bpf.c"

char LICENSE[] SEC("license") = "Dual MIT/GPL";
