#!/usr/bin/env node
// Runs before `npm start` and `npm test`: installs from the lockfile when
// node_modules is missing or older than package-lock.json, so a fresh clone
// needs no separate install step. Plain Node: nothing is installed yet.
import { spawnSync } from "node:child_process";
import { existsSync, statSync } from "node:fs";

const marker = "node_modules/.package-lock.json";
const stale =
	!existsSync(marker) ||
	statSync(marker).mtimeMs < statSync("package-lock.json").mtimeMs;
if (stale) {
	console.error("installing dependencies from the lockfile (npm ci)...");
	const r = spawnSync("npm", ["ci", "--no-audit", "--no-fund"], { stdio: "inherit" });
	process.exit(r.status ?? 1);
}
