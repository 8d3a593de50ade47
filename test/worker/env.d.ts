declare namespace Cloudflare {
	interface Env {
		TEST_D1_MIGRATIONS: import("cloudflare:test").D1Migration[];
	}
}
