//! `max_response`: one rule for every answer, whichever wire it comes on
//! and however its bulk bytes travel (inside the message, in
//! `ipc-channel`'s shared memory, in a memfd).

use berth::{Body, Bulk, ModelSpec, Supervisor, SupervisorConfig};
use berth_tests::python::python_worker_command;
use berth_tests::*;
use ipc_channel::ipc::IpcSharedMemory;

fn with_bulk(bulk: Bulk) -> Body {
    Body {
        json: "{}".into(),
        bulk,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_response_counts_bulk_bytes_in_every_form_on_both_wires() {
    let sup = Supervisor::new(SupervisorConfig {
        max_response: 16 << 10,
        ..test_config()
    });
    sup.load(ModelSpec::new("rust", "echo")).await.unwrap();
    sup.load(ModelSpec::new("python", "echo").command(python_worker_command()))
        .await
        .unwrap();
    for model in ["rust", "python"] {
        let small = sup
            .request(model, with_bulk(Bulk::Inline(vec![7; 10 << 10])))
            .await
            .unwrap_or_else(|e| panic!("{model}: 10 KiB is within 16 KiB: {e}"));
        assert_eq!(small.bulk_bytes().len(), 10 << 10, "{model}");
        for (what, bulk) in [
            (
                "60,000 bytes inside the message",
                Bulk::Inline(vec![7; 60_000]),
            ),
            (
                "1 MiB in shared memory (a memfd on the stream wire)",
                Bulk::Shared(IpcSharedMemory::from_bytes(&vec![7; 1 << 20])),
            ),
        ] {
            let err = sup.request(model, with_bulk(bulk)).await.unwrap_err();
            assert_eq!(err.kind(), "input_too_large", "{model}: {what}: {err}");
            let text = err.to_string();
            assert!(
                text.contains("max_response") && text.contains(model),
                "{model}: {what}: {text}"
            );
        }
        // The request failed alone: the worker serves on.
        let again = sup
            .request(model, with_bulk(Bulk::Inline(vec![1; 100])))
            .await
            .unwrap();
        assert_eq!(again.bulk_bytes(), &[1; 100][..], "{model}");
    }
    sup.shutdown().await;
}
