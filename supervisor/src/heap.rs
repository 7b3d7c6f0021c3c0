//! The supervisor's own heap: handing freed memory back to the kernel after
//! large answers have passed through.
//!
//! glibc keeps freed memory in its per-thread arenas, and raises its mmap
//! threshold after freeing a large block, so after one 40 MB answer the
//! supervisor's RSS would stay at its peak for good. A trim after large
//! answers gives it back; nothing is trimmed while nothing large passed.

/// Answers this large (bytes inside the message) are followed by a trim.
pub const LARGE: u64 = 1 << 20;

static TRIM_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Hands the heap's free pages back to the kernel now (glibc's
/// `malloc_trim`, which walks every arena). After a large answer passes
/// through the supervisor, glibc would otherwise keep the freed megabytes in
/// its per-thread arenas and the supervisor's RSS would stay at its peak.
pub fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and trims glibc's own arenas; it takes
    // the arenas' locks and touches no memory of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Asks for [`release_freed_heap`] once the large buffers just used are
/// freed; [`run_heap_trimmer`] does it within a quarter of a second.
pub fn trim_soon() {
    TRIM_PENDING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Trims the heap a moment after [`trim_soon`] was called: the caller's
/// buffers (a response body on its way out) are freed by then. Cheap when
/// nothing is pending; the trim itself runs off the async runtime.
pub async fn run_heap_trimmer() {
    let mut ticker = tokio::time::interval(std::time::Duration::from_millis(250));
    loop {
        ticker.tick().await;
        if TRIM_PENDING.swap(false, std::sync::atomic::Ordering::Relaxed) {
            // The response being written may still be in flight: trim once
            // now and once more after it has surely been sent.
            let _ = tokio::task::spawn_blocking(release_freed_heap).await;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let _ = tokio::task::spawn_blocking(release_freed_heap).await;
        }
    }
}
