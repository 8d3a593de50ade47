/**
 * What a Docker restore spends checking its archive (`npm run bench:restore`).
 *
 * Before `docker load`, the driver reads a snapshot archive's top-level
 * entries (`refuseNamedArchive`) so that an archive naming an image cannot
 * retag the host's template. The names it looks for sit at the end of a
 * `docker save` archive, so a gzipped snapshot is inflated whole. This
 * times that check against the whole restore it guards (load, create,
 * start), in the same run, for snapshots holding 1, 16 and 128 MiB of
 * random bytes (incompressible: the archive is as large as the data).
 *
 * Flags: --sizes 1,16,128 (MiB) --repeats 3 --image trellis-debian:latest
 *        --out FILE (default bench/results/restore.json)
 * Needs a Docker engine and the template image (`bash .ci/docker.sh`).
 */
import { execFileSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { parseArgs } from "node:util";
import { dockerFactory, refuseNamedArchive } from "../host/drivers/docker.ts";
import { median } from "./judge.ts";

const { values } = parseArgs({
	options: {
		sizes: { type: "string", default: "1,16,128" },
		repeats: { type: "string", default: "3" },
		image: { type: "string", default: "trellis-debian:latest" },
		out: { type: "string", default: "bench/results/restore.json" },
	},
});
const sizes = values.sizes.split(",").map(Number);
const repeats = Number(values.repeats);

interface Row {
	mib: number;
	archiveBytes: number;
	checkMs: number;
	restoreMs: number;
	share: number;
}

const factory = dockerFactory({ image: values.image });
const sandbox = await factory.start();
const rows: Row[] = [];
const total = sizes.length * repeats;
let done = 0;
try {
	for (const mib of sizes) {
		await sandbox.exec({
			tool: "bash",
			args: `rm -f /work/blob; head -c ${mib}M /dev/urandom > /work/blob`,
		});
		const { data } = await sandbox.snapshot();
		const source = {
			ref: { driver: "docker", key: "bench", bytes: data.length },
			read: async () => data,
		};
		const check: number[] = [];
		const restore: number[] = [];
		for (let i = 0; i < repeats; i++) {
			let t = performance.now();
			await refuseNamedArchive(data);
			check.push(performance.now() - t);
			t = performance.now();
			const restored = await factory.restore(source);
			restore.push(performance.now() - t);
			await restored.stop();
			process.stderr.write(`\r${++done}/${total} restores`);
		}
		const checkMs = median(check);
		const restoreMs = median(restore);
		rows.push({
			mib,
			archiveBytes: data.length,
			checkMs,
			restoreMs,
			share: checkMs / restoreMs,
		});
	}
} finally {
	await sandbox.stop();
	process.stderr.write("\n");
}

const git = (...args: string[]) =>
	execFileSync("git", args, { encoding: "utf8" }).trim();
const dirty = git("status", "--porcelain", "-uno") !== "";
const commit = git("rev-parse", "--short", "HEAD") + (dirty ? "+dirty" : "");
console.log(`commit ${commit}, medians of ${repeats}\n`);
console.log("| data | archive | check ms | whole restore ms | check's share |");
console.log("|---|---|---|---|---|");
for (const r of rows)
	console.log(
		`| ${r.mib} MiB | ${(r.archiveBytes / 2 ** 20).toFixed(1)} MiB | ` +
			`${r.checkMs.toFixed(1)} | ${r.restoreMs.toFixed(1)} | ` +
			`${(100 * r.share).toFixed(1)}% |`,
	);
mkdirSync(path.dirname(values.out), { recursive: true });
writeFileSync(
	values.out,
	JSON.stringify({ commit, image: values.image, repeats, rows }, null, 2) +
		"\n",
);
