//! Requests per renewal and per follower poll of the object storage lock, and their latency
//! against a plain read of the object, on moto's S3 server (`S3_ENDPOINT`, `S3_BUCKET`; see
//! `scripts/setup`). Requests are counted at the `object_store` client with its retries off,
//! where each call of a small object is one HTTP request.
//!
//! ```text
//! cargo bench -p leader-object-store --bench renewal
//! ```

use std::error::Error;

use leader_core::ResourceLock;
use leader_object_store::BucketStore;
use leader_object_store::object_store::ObjectStore;
use leader_object_store::object_store::path::Path;
use leader_test_support::bench::{self, Rewrite};
use leader_test_support::object_store_counting::Counting;

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 50;
const PER_ROUND: usize = 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    leader_object_store::ensure_crypto_provider();
    let bucket = leader_test_support::s3_bucket()?;
    let mut builder = BucketStore::from_url(&format!("s3://{bucket}/"));
    for (key, value) in leader_test_support::s3_options() {
        builder = builder.option(key, value);
    }
    let s3 = builder.build()?.object_store().clone();
    let counting = Counting::new(s3.clone());
    let store = BucketStore::builder(counting.clone(), format!("s3://{bucket}"))
        .prefix(format!("leader-bench-{:08x}/", fastrand::u32(..)))
        .build()?;
    let name = "renewal";

    // 1. Lock requests per renewal as the elector makes them: a real elector on a counting
    //    wrapper of the lock.
    let elector = bench::elected(store.lock(name, "bench"), bench::SHORT).await?;

    // The elector released the lease on shutdown: take it again as a plain update, so that
    // what follows are renewals by the holder.
    let lock = store.lock(name, "bench");
    let current = lock.get().await?.ok_or("the record is gone")?;
    let mut observed = lock
        .update(
            &current.version,
            &bench::renewed(&leader_core::conformance::record("bench", 1)),
        )
        .await?;

    // 2. Store requests per renewal, and per poll of an unchanged record by a follower.
    const N: usize = 300;
    let before = counting.total();
    bench::rewrites(&lock, &mut observed, N, Rewrite::Renew).await?;
    let per_renewal = (counting.total() - before) as f64 / N as f64;
    let follower = store.lock(name, "follower");
    follower.get().await?;
    let before = counting.counts();
    for _ in 0..N {
        follower.get().await?;
    }
    let after = counting.counts();
    let polls: Vec<String> = after
        .iter()
        .filter_map(|(kind, count)| {
            let added = count - before.get(kind).copied().unwrap_or(0);
            (added > 0).then(|| format!("{kind} {:.2}", added as f64 / N as f64))
        })
        .collect();

    // 3. Latency: a renewal (conditional PUT), a follower's poll (GET answered 304), and a
    //    plain GET of the object through the same client.
    let path = Path::from(format!("{}{name}", store.prefix()));
    let (mut t_get, mut t_poll, mut t_renew) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bench::time_each(PER_ROUND, &mut t_get, async || {
            s3.get_opts(&path, Default::default()).await?.bytes().await
        })
        .await?;
        bench::time_each(PER_ROUND, &mut t_poll, async || follower.get().await).await?;
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Renew).await?);
        // The renewals changed the record: one full read, then the polls are 304s again.
        follower.get().await?;
    }

    println!(
        "object storage lock on moto's S3 server ({})",
        leader_test_support::s3_endpoint()
    );
    elector.print();
    println!("S3 requests per renewal ({N} renewals): {per_renewal:.2} (PUT If-Match)");
    println!(
        "S3 requests per follower poll of an unchanged record ({N} polls): {}",
        polls.join(", ")
    );
    println!();
    bench::print_latencies(
        "operation (same client)",
        0,
        &mut [
            ("plain GET of the object", t_get),
            ("follower poll (GET If-None-Match, 304)", t_poll),
            ("renewal (PUT If-Match)", t_renew),
        ],
    );
    Ok(())
}
