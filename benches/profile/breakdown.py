#!/usr/bin/env python3
"""Where a push+pull pair's CPU time goes: reads `perf script` output of an `edl-bench
transport` run recorded with DWARF call graphs, and sorts every sample into a category by its
leaf function and, for copies and page clearing, by the first caller that says whose copy it
is. Prints one Markdown table row per category (share of all samples).

Run through benches/profile/run.sh, which records and calls this."""
import collections
import re
import sys

# (category, leaf pattern, pattern of the leaf or a caller, or None); the first that matches
# wins.
RULES = [
    ("AES-GCM (QUIC packet protection)", r"aes|gcm|ghash|EVP_AEAD|HeaderProtection", None),
    ("copy into QUIC packets (send)", r"memcpy|memmove", r"write_stream_frames|poll_transmit|PacketBuilder"),
    ("copy out of the UDP buffer (quinn receive)", r"memcpy|memmove", r"RecvState::poll_socket|BytesMut as core::convert::From"),
    ("copy into the caller's buffer (pull)", r"memcpy|memmove", r"PullSink|Counted<|pull_all|pull_keys|pull_rows"),
    ("copy into a wire buffer (push of a borrowed slice)", r"memcpy|memmove", r"extend_finite_f32s|extend_f32s|push_all"),
    ("other user-space copies", r"memcpy|memmove", None),
    ("kernel: UDP send and receive (copies, sockets)", r"rep_movs|copy_user|_copy_|skb|udp|ip_|sock|sendmsg|recvmsg|csum|nf_|dev_|napi|netif|loopback|__x64_sys|do_syscall|entry_SYSCALL", None),
    ("page faults (fresh memory)", r"clear_page|folio|page_fault|do_anonymous|huge_pmd", None),
    ("kernel: scheduling, interrupts, timers", r"spin|irq|schedule|futex|vdso|clock_gettime|put_user|check_object|entry_|exit_to_user|switch|hrtimer|rcu|epoll|ep_poll|wake", None),
    # These loops run inside `edl_proto::wide`'s per-CPU versions: whose loop it is shows in
    # the callers (or the inlined frames).
    ("finiteness checks (client and shard)", r".", r"first_non_finite|FiniteScan|first_bad"),
    ("optimizer (SGD)", r".", r"OptState|apply_at|apply_run|apply_chunks"),
    ("allocator", r"_mi_|mi_malloc|mi_free|malloc|free", None),
    ("quinn protocol logic", r"quinn", None),
    ("tokio scheduling", r"tokio", None),
]


def frames(block):
    out = []
    for line in block.split("\n")[1:]:
        line = line.strip()
        if not line:
            continue
        parts = line.split(None, 1)
        if len(parts) == 2:
            out.append(re.sub(r"\s*\(.*\)$", "", parts[1]))
    return out


def category(stack):
    leaf = stack[0]
    for name, leaf_pat, caller_pat in RULES:
        if not re.search(leaf_pat, leaf):
            continue
        if caller_pat is None or any(re.search(caller_pat, f) for f in stack):
            return name
    return "other"


def main():
    counts = collections.Counter()
    for block in sys.stdin.read().split("\n\n"):
        stack = frames(block)
        if stack:
            counts[category(stack)] += 1
    total = sum(counts.values()) or 1
    print("| where | share of CPU samples |")
    print("|---|---|")
    for name, n in counts.most_common():
        print(f"| {name} | {100 * n / total:.1f}% |")
    print(f"\n{total} samples.")


if __name__ == "__main__":
    main()
