//! TCP store: semantics, blocking, timeouts, run token, size limits, prefix views, bind errors (127.0.0.1 only).

use ddp_core::store::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use ddp_core::{DdpError, PrefixStore, RunToken, Store, TcpStore, TcpStoreServer};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Generous: waits that should succeed must survive a loaded 2-core machine.
const LONG: Duration = Duration::from_secs(60);

fn server() -> (TcpStoreServer, RunToken) {
    let token = RunToken::generate().unwrap();
    (TcpStoreServer::bind("127.0.0.1:0", token).unwrap(), token)
}

fn client(server: &TcpStoreServer, token: RunToken, timeout: Duration) -> TcpStore {
    TcpStore::connect(&server.local_addr().to_string(), token, timeout).unwrap()
}

#[test]
fn every_operation_has_the_documented_semantics() {
    let (server, token) = server();
    let s = client(&server, token, LONG);

    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    s.set("a", b"two").unwrap();
    assert_eq!(s.get("a").unwrap(), b"two");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");

    // add: ASCII decimal, missing key counts as 0, returns the new value.
    assert_eq!(s.add("counter", 5).unwrap(), 5);
    assert_eq!(s.add("counter", -2).unwrap(), 3);
    assert_eq!(s.get("counter").unwrap(), b"3");
    let err = s.add("a", 1).unwrap_err();
    assert!(matches!(err, DdpError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("\"a\""), "{err}");

    // compare_set: missing key matches empty `expected`; returns the value after the call.
    assert_eq!(s.compare_set("cas", b"", b"x").unwrap(), b"x");
    assert_eq!(s.compare_set("cas", b"nope", b"y").unwrap(), b"x");
    assert_eq!(s.compare_set("cas", b"x", b"y").unwrap(), b"y");
    assert_eq!(s.compare_set("missing", b"something", b"z").unwrap(), b"");
    assert!(!s.check(&["missing"]).unwrap());

    // check / wait / delete / num_keys.
    assert!(s.check(&["a", "counter", "cas"]).unwrap());
    assert!(!s.check(&["a", "absent"]).unwrap());
    assert!(s.check(&[]).unwrap());
    s.wait(&["a", "cas"], LONG).unwrap();
    assert_eq!(s.num_keys().unwrap(), 4); // a, empty, counter, cas
    assert_eq!(server.num_keys(), 4);
    assert!(s.delete_key("a").unwrap());
    assert!(!s.delete_key("a").unwrap());
    assert_eq!(s.num_keys().unwrap(), 3);
    assert_eq!(s.timeout(), LONG);

    // Binary values survive unchanged.
    let blob: Vec<u8> = (0..=255u8).cycle().take(100_003).collect();
    s.set("blob", &blob).unwrap();
    assert_eq!(s.get("blob").unwrap(), blob);
}

#[test]
fn blocking_get_is_woken_by_a_later_set_from_another_client() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let waiter = std::thread::spawn(move || {
        let s = TcpStore::connect(&addr, token, LONG).unwrap();
        let v = s.get("late").unwrap();
        s.wait(&["late", "later"], LONG).unwrap();
        v
    });
    std::thread::sleep(Duration::from_millis(100));
    let setter = client(&server, token, LONG);
    setter.set("late", b"value").unwrap();
    setter.set("later", b"").unwrap();
    assert_eq!(waiter.join().unwrap(), b"value");
}

#[test]
fn a_thread_blocked_in_get_does_not_starve_other_threads_of_the_same_client() {
    let (server, token) = server();
    let s = Arc::new(client(&server, token, LONG));
    let s2 = s.clone();
    let blocked = std::thread::spawn(move || s2.get("go").unwrap());
    std::thread::sleep(Duration::from_millis(100));
    // Same client, other thread: these must complete while the get above is parked on the server.
    assert_eq!(s.add("n", 1).unwrap(), 1);
    s.set("go", b"now").unwrap();
    assert_eq!(blocked.join().unwrap(), b"now");
}

#[test]
fn get_and_wait_time_out_with_an_error_naming_the_key_and_the_time() {
    let (server, token) = server();
    let s = client(&server, token, LONG).with_timeout(Duration::from_millis(300));
    s.set("present", b"1").unwrap();
    match s.get("never-set-key") {
        Err(DdpError::StoreTimeout { keys, waited }) => {
            assert_eq!(keys, vec!["never-set-key".to_string()]);
            assert!(waited >= Duration::from_millis(300), "{waited:?}");
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    let err = s.wait(&["present", "absent-1", "absent-2"], Duration::from_millis(200)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("absent-1") && msg.contains("absent-2") && !msg.contains("present"), "{msg}");
    assert!(msg.contains("timed out after") && msg.contains(" s waiting"), "{msg}");
    match err {
        DdpError::StoreTimeout { waited, .. } => assert!(waited >= Duration::from_millis(200), "{waited:?}"),
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    // The connection is still usable after a timeout.
    assert_eq!(s.get("present").unwrap(), b"1");
}

#[test]
fn a_wrong_or_missing_run_token_is_refused() {
    let (server, _token) = server();
    let addr = server.local_addr().to_string();
    let wrong = RunToken::generate().unwrap();
    match TcpStore::connect(&addr, wrong, LONG) {
        Err(DdpError::TokenRejected { peer }) => assert_eq!(peer, addr),
        other => panic!("expected TokenRejected, got {other:?}"),
    }

    // A peer that skips the handshake gets nothing served: the server closes on it.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    raw.write_all(&[0u8; 24]).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "server must close a connection with a bad hello");
    assert_eq!(server.num_connections(), 0);
}

#[test]
fn oversized_keys_and_values_are_refused_on_both_sides() {
    let (server, token) = server();
    let s = client(&server, token, LONG);

    let big = vec![0u8; MAX_VALUE_BYTES + 1];
    let err = s.set("big", &big).unwrap_err();
    assert!(matches!(err, DdpError::Protocol(_)), "{err}");
    assert!(err.to_string().contains("MAX_VALUE_BYTES"), "{err}");
    let long_key = "k".repeat(MAX_KEY_BYTES + 1);
    let err = s.get(&long_key).unwrap_err();
    assert!(err.to_string().contains("MAX_KEY_BYTES"), "{err}");
    // Nothing was stored and the client still works.
    assert_eq!(s.num_keys().unwrap(), 0);
    let max_key = "k".repeat(MAX_KEY_BYTES);
    s.set(&max_key, b"ok").unwrap();
    assert_eq!(s.get(&max_key).unwrap(), b"ok");

    // Server side: a hand-written client that authenticates and then announces a 1 GiB frame gets an error
    // answer and a closed connection, and the server keeps serving others.
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    let mut hello = Vec::new();
    hello.extend_from_slice(b"ACST");
    hello.extend_from_slice(&1u16.to_le_bytes());
    hello.extend_from_slice(&[0, 0]);
    hello.extend_from_slice(token.as_bytes());
    raw.write_all(&hello).unwrap();
    let mut ok = [0u8; 1];
    raw.read_exact(&mut ok).unwrap();
    assert_eq!(ok[0], 0, "handshake with the right token is accepted");
    raw.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("frame of 1073741824 bytes"), "{text:?}");
    assert_eq!(s.get(&max_key).unwrap(), b"ok");
}

#[test]
fn prefix_store_namespaces_keys() {
    let (server, token) = server();
    let base: Arc<dyn Store> = Arc::new(client(&server, token, LONG));
    let g1 = PrefixStore::new("group1", base.clone());
    let g2 = PrefixStore::new("group2", base.clone());
    g1.set("k", b"one").unwrap();
    g2.set("k", b"two").unwrap();
    assert_eq!(g1.get("k").unwrap(), b"one");
    assert_eq!(g2.get("k").unwrap(), b"two");
    assert_eq!(base.get("group1/k").unwrap(), b"one");
    assert_eq!(g1.add("n", 2).unwrap(), 2);
    assert_eq!(base.get("group1/n").unwrap(), b"2");
    assert!(g1.check(&["k", "n"]).unwrap());
    assert!(!g2.check(&["n"]).unwrap());
    assert_eq!(g2.compare_set("k", b"two", b"2").unwrap(), b"2");
    assert!(g1.delete_key("k").unwrap());
    assert!(base.check(&["group2/k"]).unwrap() && !base.check(&["group1/k"]).unwrap());
    assert_eq!(g1.num_keys().unwrap(), base.num_keys().unwrap());

    // Nested prefixes and errors naming the full key.
    let nested = PrefixStore::new("sub", Arc::new(g1.clone()));
    nested.set("x", b"1").unwrap();
    assert_eq!(base.get("group1/sub/x").unwrap(), b"1");
    let err = nested.wait(&["missing"], Duration::from_millis(100)).unwrap_err().to_string();
    assert!(err.contains("group1/sub/missing"), "{err}");
}

#[test]
fn binding_a_port_in_use_names_host_and_port() {
    let (server, token) = server();
    let addr = format!("127.0.0.1:{}", server.port());
    match TcpStoreServer::bind(&addr, token) {
        Err(e @ DdpError::Bind { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&addr), "{msg}");
            assert!(msg.contains("MASTER_PORT"), "{msg}");
        }
        other => panic!("expected a Bind error, got {other:?}"),
    }
}

#[test]
fn connect_retries_until_the_server_comes_up() {
    // Find a free port, release it, and bring a server up on it a little after the client starts connecting.
    let port = TcpStoreServer::bind("127.0.0.1:0", RunToken::generate().unwrap()).unwrap().port();
    let token = RunToken::generate().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let server = TcpStoreServer::bind(&format!("127.0.0.1:{port}"), token).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        server
    });
    let s = TcpStore::connect(&addr, token, LONG).unwrap();
    s.set("k", b"v").unwrap();
    assert_eq!(s.get("k").unwrap(), b"v");
    assert!(s.local_ip().is_loopback());
    let s2 = s.try_clone_connection().unwrap();
    assert_eq!(s2.get("k").unwrap(), b"v");
    drop(starter.join().unwrap());
}

#[test]
fn connect_gives_up_after_its_timeout_naming_the_address() {
    let port = TcpStoreServer::bind("127.0.0.1:0", RunToken::generate().unwrap()).unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    match TcpStore::connect(&addr, RunToken::generate().unwrap(), Duration::from_millis(300)) {
        Err(e @ DdpError::Connect { .. }) => {
            assert!(e.to_string().contains(&addr), "{e}");
        }
        other => panic!("expected a Connect error, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(300));
}

#[test]
fn dropping_the_server_fails_blocked_and_later_calls_instead_of_hanging() {
    let (server, token) = server();
    let s = Arc::new(client(&server, token, LONG));
    let s2 = s.clone();
    let blocked = std::thread::spawn(move || s2.get("never"));
    std::thread::sleep(Duration::from_millis(100));
    drop(server);
    let err = blocked.join().unwrap().unwrap_err();
    assert!(!matches!(err, DdpError::StoreTimeout { .. }), "{err}");
    assert!(s.set("k", b"v").is_err());
}

#[test]
fn many_clients_count_together() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let s = TcpStore::connect(&addr, token, LONG).unwrap();
                for _ in 0..50 {
                    s.add("total", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client(&server, token, LONG).get("total").unwrap(), b"400");
}
