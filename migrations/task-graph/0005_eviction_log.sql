CREATE TABLE `eviction_log` (
	`seq` integer PRIMARY KEY AUTOINCREMENT NOT NULL,
	`node_id` text NOT NULL,
	`reason` text NOT NULL,
	`tool` text,
	`at` integer NOT NULL
);
