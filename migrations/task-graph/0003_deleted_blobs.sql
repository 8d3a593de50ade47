CREATE TABLE `deleted_blobs` (
	`key` text PRIMARY KEY NOT NULL,
	`deleted_at` integer NOT NULL
);
