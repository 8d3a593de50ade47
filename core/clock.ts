/**
 * The one clock the Worker and the task graph read. Tests move it forward to
 * expire leases without sleeping; nothing else does.
 */
let offsetMs = 0;

export function now(): number {
	return Date.now() + offsetMs;
}

/** For tests: every later `now()` reads `ms` further ahead. */
export function advanceClock(ms: number): void {
	offsetMs += ms;
}
