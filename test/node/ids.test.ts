/**
 * The client computes ids with `core/ids.ts`, re-exported from the client
 * package: these tests hold it to the committed vectors every client must
 * reproduce (the brief's invariant 2).
 */
import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import {
	ROOT_ID,
	callKey,
	canonicalCall,
	finalState,
	pathIds,
	type Call,
} from "../../client/index.ts";

interface Vectors {
	root: string;
	calls: { call: Call; canonical: string; key: string }[];
	paths: { calls: Call[]; ids: string[] }[];
}

const vectors = JSON.parse(
	readFileSync(new URL("../vectors/ids.json", import.meta.url), "utf8"),
) as Vectors;

describe("canonical ids", () => {
	it("the client's root id is the vectors' root", () => {
		expect(ROOT_ID).toBe(vectors.root);
	});

	it.each(vectors.calls.map((v, i) => [i, v.call.tool, v] as const))(
		"call vector %i (%s) gives the vector's canonical JSON and key",
		(_i, _tool, v) => {
			expect(canonicalCall(v.call)).toBe(v.canonical);
			expect(callKey(v.call)).toBe(v.key);
		},
	);

	it.each(vectors.paths.map((v, i) => [i, v.calls.length, v] as const))(
		"path vector %i (%i calls) gives the vector's ids",
		(_i, _n, v) => {
			expect(pathIds(v.calls).map((s) => s.id)).toEqual(v.ids);
		},
	);

	it("a path's final state is its last state-changing call's id, or the root", () => {
		for (const v of vectors.paths) {
			const steps = pathIds(v.calls);
			const last = steps.filter((s) => s.mutates).at(-1);
			expect(finalState(v.calls)).toBe(last?.id ?? vectors.root);
		}
	});

	it("the vectors cover keys that JCS must reorder and calls without args", () => {
		// Guards the vectors themselves: a trimmed file would pass the loops above.
		expect(vectors.calls.length).toBeGreaterThanOrEqual(15);
		expect(vectors.calls.some((v) => v.call.args === undefined)).toBe(true);
		expect(
			vectors.paths.some((p) => p.calls.some((c) => c.mutates === false)),
		).toBe(true);
	});
});
