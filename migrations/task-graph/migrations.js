import journal from './meta/_journal.json';
import m0000 from './0000_init.sql';
import m0001 from './0001_managed.sql';
import m0002 from './0002_eviction.sql';
import m0003 from './0003_deleted_blobs.sql';
import m0004 from './0004_conflict_outputs.sql';
import m0005 from './0005_eviction_log.sql';

  export default {
    journal,
    migrations: {
      m0000,
m0001,
m0002,
m0003,
m0004,
m0005
    }
  }
  