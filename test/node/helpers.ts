/**
 * Shared pieces of the Node tests: temporary directories that clean
 * themselves up, unique task names, and a real shell log outside any
 * sandbox that commands append to, so a test can count what really ran.
 */
import { randomBytes } from "node:crypto";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";

const made: string[] = [];

/** A fresh directory under the system temp dir, removed by {@link cleanTmp}. */
export async function tmp(prefix: string): Promise<string> {
	const dir = await mkdtemp(path.join(tmpdir(), `trellis-${prefix}-`));
	made.push(dir);
	return dir;
}

/** Removes every directory {@link tmp} made. */
export async function cleanTmp(): Promise<void> {
	await Promise.all(
		made.splice(0).map((d) => rm(d, { recursive: true, force: true })),
	);
}

/** A task name no other test (or earlier run over the same state) uses. */
export function taskName(label: string): string {
	return `${label}-${randomBytes(6).toString("hex")}`;
}

/** The lines of a log file, none if it does not exist yet. */
export async function logLines(file: string): Promise<string[]> {
	try {
		return (await readFile(file, "utf8")).split("\n").filter((l) => l !== "");
	} catch {
		return [];
	}
}

/** How many lines of a log are exactly `line`. */
export async function countLines(file: string, line: string): Promise<number> {
	return (await logLines(file)).filter((l) => l === line).length;
}
