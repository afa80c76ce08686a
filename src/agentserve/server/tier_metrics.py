"""/metrics for the lower KV tiers: a collector that reads the engine's tier counters when
scraped (plain reads of ints and floats the engine thread updates; a scrape may see a step
half applied, never a torn number)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from agentserve.engine.tiers import KvTiers

P = "agentserve_kv_tier_"


class TierCollector(Collector):
    def __init__(self, tiers: KvTiers) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        t, c = self.tiers, self.tiers.counters
        used = GaugeMetricFamily(P + "used_bytes", "Bytes held, by tier", labels=["tier"])
        cap = GaugeMetricFamily(P + "capacity_bytes", "Bound, by tier", labels=["tier"])
        blocks = GaugeMetricFamily(P + "blocks", "Blocks held, by tier", labels=["tier"])
        used.add_metric(["host"], t.host.used_bytes)
        cap.add_metric(["host"], t.host.capacity_bytes)
        blocks.add_metric(["host"], len(t.host.index))
        moved = CounterMetricFamily(P + "bytes_moved", "Bytes copied, by path",
                                    labels=["path"])
        seconds = CounterMetricFamily(P + "copy_seconds", "Time copying, by path (bandwidth = "
                                      "bytes_moved / copy_seconds)", labels=["path"])
        for path, nbytes, s in (("device_to_host", c.bytes_gathered, c.gather_s),
                                ("host_to_device", c.bytes_scattered, c.scatter_s),
                                ("disk_read", c.bytes_read_disk, c.read_disk_s),
                                ("disk_write", c.bytes_written_disk, c.write_disk_s)):
            moved.add_metric([path], nbytes)
            seconds.add_metric([path], s)
        ops = CounterMetricFamily(P + "blocks_total", "Blocks, by operation", labels=["op"])
        for op, n in (("offloaded", c.num_offloaded_blocks), ("restored", c.num_restored_blocks),
                      ("loaded_from_disk", c.num_loaded_blocks), ("disk_written", c.num_disk_written_blocks),
                      ("disk_write_failed", c.num_disk_write_failures),
                      ("disk_read_missed", c.num_disk_read_misses)):
            ops.add_metric([op], n)
        wait = SummaryMetricFamily(P + "restore_wait_seconds", "Requests that waited for a disk read: "
                                   "admission to read done", count_value=c.num_restore_waits,
                                   sum_value=c.restore_wait_s)
        prefetch = CounterMetricFamily(P + "prefetch_blocks", "Prefetched blocks, by outcome", labels=["outcome"])
        for outcome, n in (("prefetched", c.num_prefetched_blocks), ("used", c.num_prefetch_used),
                           ("wasted", c.num_prefetch_wasted), ("displaced", c.num_prefetch_displaced)):
            prefetch.add_metric([outcome], n)
        refused = CounterMetricFamily(P + "jobs_refused", "I/O jobs refused by a full worker queue")
        refused.add_metric([], c.num_jobs_refused)
        out = [used, cap, blocks, moved, seconds, ops, refused, wait, prefetch]
        if t.disk is not None:
            d = t.disk.stats()
            used.add_metric(["disk"], d.used_bytes)
            cap.add_metric(["disk"], t.disk.capacity_bytes)
            blocks.add_metric(["disk"], d.num_files)
            fails = CounterMetricFamily(P + "verify_failures", "Disk files that failed verification "
                                        "(deleted, recomputed)")
            fails.add_metric([], d.num_verify_failures)
            errors = CounterMetricFamily(P + "disk_write_errors", "Disk writes that failed (full, unwritable)")
            errors.add_metric([], d.num_write_errors)
            out += [fails, errors]
        yield from out
