//! The conformance suite against both locks of the core.

use std::sync::Arc;

use leader_core::conformance::{self, LockFactory};
use leader_core::{FileLock, MemoryStore, ResourceLock, async_trait};

struct Memory {
    store: MemoryStore,
    store_clock: bool,
    renewal_in_store: bool,
}

#[async_trait]
impl LockFactory for Memory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(
            self.store
                .lock(name, identity)
                .with_store_clock(self.store_clock)
                .with_renewal_in_store(self.renewal_in_store),
        )
    }

    async fn corrupt(&self, name: &str) -> bool {
        self.store.corrupt(name, "garbage");
        true
    }
}

struct Files {
    dir: tempfile::TempDir,
}

#[async_trait]
impl LockFactory for Files {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(FileLock::new(self.dir.path().join(name), identity))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let dir = self.dir.path().join(name);
        std::fs::create_dir_all(&dir).expect("lock directory");
        std::fs::write(
            dir.join("v00000000000000000001.json"),
            b"{\"holder\": [1, 2",
        )
        .expect("write garbage");
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_lock_conforms() {
    conformance::run_all(&Memory {
        store: MemoryStore::new(),
        store_clock: false,
        renewal_in_store: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_lock_with_store_clock_conforms() {
    conformance::run_all(&Memory {
        store: MemoryStore::new(),
        store_clock: true,
        renewal_in_store: false,
    })
    .await;
}

/// Renewals that only extend the lease in the store, as etcd's and Redis's locks do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_lock_with_renewal_in_store_conforms() {
    conformance::run_all(&Memory {
        store: MemoryStore::new(),
        store_clock: true,
        renewal_in_store: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_lock_conforms() {
    conformance::run_all(&Files {
        dir: tempfile::tempdir().expect("tempdir"),
    })
    .await;
}

/// A file where the lock directory should be (a record written by hand, or an older layout) is
/// reported, not overwritten.
#[tokio::test]
async fn file_lock_reports_a_record_in_the_wrong_layout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("election");
    let bytes = conformance::record("a", 1).to_json();
    std::fs::write(&path, &bytes).expect("write");
    let lock = FileLock::new(&path, "a");
    let err = lock.get().await.expect_err("layout");
    assert!(err.to_string().contains("is not a directory"), "{err}");
    assert!(lock.create(&conformance::record("a", 1)).await.is_err());
    assert_eq!(std::fs::read(&path).expect("kept"), bytes);
}
