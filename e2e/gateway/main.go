// Command gateway plays Envoy's side of the external-processing protocol for an
// InferencePool, so the tests can put an endpoint picker (fleetpilot's, or the Gateway API
// Inference Extension's own EPP) behind a gateway without an Envoy binary.
//
// For each HTTP request it does what Envoy's ext_proc filter does in the mode GIE configures
// for InferencePools (FULL_DUPLEX_STREAMED request and response bodies, every phase sent):
//
//  1. opens one Process stream to the picker and sends the request headers (pseudo-headers
//     :method, :path, :authority, :scheme included, values as raw bytes), then the body in
//     chunks as it arrives, the last with end_of_stream; every message carries the forwarded
//     dynamic metadata (the subset hint), as Envoy attaches it to body chunks too;
//  2. reads the picker's answers: an ImmediateResponse goes to the client as is; otherwise the
//     request-headers answer (header mutations under Envoy's default mutation rules: :path
//     may change, host, :authority, :scheme, :method and x-envoy-* are ignored; the picked
//     endpoints in x-gateway-destination-endpoint and - identically, or it is a protocol
//     error - in the envoy.lb dynamic metadata), then the body as streamed chunks until
//     end_of_stream;
//  3. sends the mutated request to the first endpoint, falling back down the list on a
//     connection failure (proposal 004's fallbacks);
//  4. sends the response headers with x-gateway-destination-endpoint-served in the envoy.lb
//     metadata context, applies the answer's mutations, then streams the response body to
//     the picker and the picker's answers to the client in full duplex (a picker may answer
//     each chunk, or hold a JSON body until its last as GIE's does), flushing each.
//
// A picker that cannot be reached, breaks the protocol or times out gives the client a 503
// with an OpenAI-style JSON error (Envoy's failure_mode_allow=false, GIE's FailClose).
//
// With several pickers (replicas of one), each request's stream goes to the next in turn, as
// Envoy balances ext_proc streams over a picker Service's endpoints. With --endpoints and no
// picker it is a plain round-robin gateway: the baseline the benchmarks hold pickers against.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	destinationNamespace = "envoy.lb"
	destinationKey       = "x-gateway-destination-endpoint"
	servedKey            = "x-gateway-destination-endpoint-served"
	subsetNamespace      = "envoy.lb.subset_hint"
	subsetKey            = "x-gateway-destination-endpoint-subset"
	// Body chunks go to the picker at most this big, as Envoy's buffers cut them.
	chunkBytes = 16 * 1024
)

type gateway struct {
	// The pickers, each request's stream on the next in turn, as Envoy balances ext_proc
	// streams over the endpoints of the picker's Service (several picker replicas).
	pickers []extprocv3.ExternalProcessorClient
	// Without a picker: the endpoints each request goes to in turn (a plain round-robin
	// gateway, the baseline a picker is measured against).
	endpoints     []string
	turn          atomic.Uint64
	upstream      *http.Client
	messageTimout time.Duration
	subset        []string // sent as the subset hint when set
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to serve HTTP on")
	picker := flag.String("picker", "",
		"the endpoint picker's gRPC address (host:port), or several, comma-separated")
	endpoints := flag.String("endpoints", "",
		"without --picker: comma-separated endpoints the requests go to in turn")
	subset := flag.String("subset", "", "comma-separated endpoints sent as the subset hint")
	timeout := flag.Duration("message-timeout", 30*time.Second, "the picker's time per answer")
	pickerTLS := flag.Bool("picker-tls", false,
		"connect to the picker over TLS without verifying its certificate, as gateways do")
	flag.Parse()
	if (*picker == "") == (*endpoints == "") {
		log.Fatal("one of --picker and --endpoints is required")
	}
	transport := insecure.NewCredentials()
	if *pickerTLS {
		// An InferencePool names no CA: gateways encrypt without verifying the picker.
		transport = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec
	}
	g := &gateway{
		upstream: &http.Client{Transport: &http.Transport{
			DisableCompression: true, MaxIdleConnsPerHost: 256,
		}},
		messageTimout: *timeout,
	}
	if *endpoints != "" {
		g.endpoints = strings.Split(*endpoints, ",")
	}
	for _, address := range strings.Split(*picker, ",") {
		if address == "" {
			continue
		}
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(transport))
		if err != nil {
			log.Fatalf("picker %s: %v", address, err)
		}
		g.pickers = append(g.pickers, extprocv3.NewExternalProcessorClient(conn))
	}
	if *subset != "" {
		g.subset = strings.Split(*subset, ",")
	}
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("listen %s: %v", *listen, err)
	}
	// The tests read the bound address (with --listen host:0) from this first line.
	fmt.Fprintf(os.Stdout, "{\"listening\": %q}\n", listener.Addr().String())
	log.Fatal(http.Serve(listener, g))
}

// refuse answers the client as a gateway does when the picker fails (FailClose).
func refuse(w http.ResponseWriter, status int, message string) {
	w.Header().Set("content-type", "application/json")
	w.WriteHeader(status)
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": message, "type": "ServiceUnavailableError", "code": status, "param": nil,
	}})
	_, _ = w.Write(body)
}

// stream wraps one Process stream with the per-answer timeout Envoy applies.
type stream struct {
	client  extprocv3.ExternalProcessor_ProcessClient
	timeout time.Duration
	answers chan answer
}

type answer struct {
	response *extprocv3.ProcessingResponse
	err      error
}

func (s *stream) receive() {
	for {
		response, err := s.client.Recv()
		s.answers <- answer{response, err}
		if err != nil {
			close(s.answers)
			return
		}
	}
}

func (s *stream) next() (*extprocv3.ProcessingResponse, error) {
	select {
	case a, ok := <-s.answers:
		if !ok {
			return nil, io.EOF
		}
		return a.response, a.err
	case <-time.After(s.timeout):
		return nil, errors.New("the picker did not answer in time")
	}
}

func headerMap(pairs map[string]string) *corev3.HeaderMap {
	out := &corev3.HeaderMap{}
	for key, value := range pairs {
		out.Headers = append(out.Headers, &corev3.HeaderValue{Key: key, RawValue: []byte(value)})
	}
	return out
}

func flatten(header http.Header) map[string]string {
	out := map[string]string{}
	for key, values := range header {
		out[strings.ToLower(key)] = strings.Join(values, ",")
	}
	return out
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	turn := g.turn.Add(1) - 1
	if len(g.pickers) == 0 {
		g.roundRobin(w, r, g.endpoints[turn%uint64(len(g.endpoints))])
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	client, err := g.pickers[turn%uint64(len(g.pickers))].Process(ctx)
	if err != nil {
		refuse(w, http.StatusServiceUnavailable, "endpoint picker unreachable: "+err.Error())
		return
	}
	s := &stream{client: client, timeout: g.messageTimout, answers: make(chan answer, 64)}
	go s.receive()
	if err := g.serve(w, r, s); err != nil {
		log.Printf("%s %s: %v", r.Method, r.URL.Path, err)
	}
	_ = client.CloseSend()
}

// roundRobin sends the request to endpoint as it came and streams the answer back.
func (g *gateway) roundRobin(w http.ResponseWriter, r *http.Request, endpoint string) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	headers := r.Header.Clone()
	response, _, err := g.send(r, r.URL.RequestURI(), headers, body, []string{endpoint})
	if err != nil {
		refuse(w, http.StatusServiceUnavailable, "no endpoint could be reached: "+err.Error())
		return
	}
	defer response.Body.Close()
	for key, values := range response.Header {
		for _, value := range values {
			w.Header().Add(key, value)
		}
	}
	w.WriteHeader(response.StatusCode)
	buffer := make([]byte, chunkBytes)
	flusher, _ := w.(http.Flusher)
	for {
		n, readErr := response.Body.Read(buffer)
		if n > 0 {
			if _, err := w.Write(buffer[:n]); err != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
		if readErr != nil {
			return
		}
	}
}

// immediate writes a picker's ImmediateResponse to the client.
func immediate(w http.ResponseWriter, response *extprocv3.ImmediateResponse) {
	for _, option := range response.GetHeaders().GetSetHeaders() {
		w.Header().Set(option.GetHeader().GetKey(), headerValue(option.GetHeader()))
	}
	status := int(response.GetStatus().GetCode())
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	_, _ = w.Write(response.GetBody())
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

func (g *gateway) serve(w http.ResponseWriter, r *http.Request, s *stream) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return err
	}
	headers := flatten(r.Header)
	headers[":method"] = r.Method
	headers[":path"] = r.URL.RequestURI()
	headers[":authority"] = r.Host
	headers[":scheme"] = "http"
	// Envoy attaches the dynamic metadata it forwards (here the subset hint) to every message
	// of the stream, body chunks included; GIE's picker reads it from the last one it got.
	metadata, err := g.metadata("")
	if err != nil {
		return err
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(headers), EndOfStream: len(body) == 0,
		}},
		MetadataContext: metadata,
	}
	if err := s.client.Send(first); err != nil {
		refuse(w, http.StatusServiceUnavailable, "endpoint picker unreachable: "+err.Error())
		return err
	}
	for start := 0; start < len(body); start += chunkBytes {
		end := min(start+chunkBytes, len(body))
		err := s.client.Send(&extprocv3.ProcessingRequest{
			Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
				Body: body[start:end], EndOfStream: end == len(body),
			}},
			MetadataContext: metadata,
		})
		if err != nil {
			break // the picker answered (an immediate response) and closed: read it below
		}
	}
	picked, err := s.next()
	if err != nil {
		refuse(w, http.StatusServiceUnavailable, "endpoint picker: "+err.Error())
		return err
	}
	if im := picked.GetImmediateResponse(); im != nil {
		immediate(w, im)
		return nil
	}
	headersAnswer := picked.GetRequestHeaders()
	if headersAnswer == nil {
		refuse(w, http.StatusServiceUnavailable, "endpoint picker: no answer to the headers")
		return fmt.Errorf("expected a request-headers answer, got %T", picked.GetResponse())
	}
	upstreamHeaders := http.Header{}
	for key, value := range headers {
		if !strings.HasPrefix(key, ":") {
			upstreamHeaders.Set(key, value)
		}
	}
	mutation := headersAnswer.GetResponse().GetHeaderMutation()
	path := r.URL.RequestURI()
	for _, option := range mutation.GetSetHeaders() {
		key := strings.ToLower(option.GetHeader().GetKey())
		switch {
		case key == ":path":
			path = headerValue(option.GetHeader())
		case !mutable(key):
			continue
		default:
			upstreamHeaders.Set(key, headerValue(option.GetHeader()))
		}
	}
	for _, name := range mutation.GetRemoveHeaders() {
		if mutable(strings.ToLower(name)) {
			upstreamHeaders.Del(name)
		}
	}
	inHeader := upstreamHeaders.Get(destinationKey)
	inMetadata := ""
	if ns := picked.GetDynamicMetadata().GetFields()[destinationNamespace]; ns != nil {
		inMetadata = ns.GetStructValue().GetFields()[destinationKey].GetStringValue()
	}
	if inHeader == "" || inHeader != inMetadata {
		refuse(w, http.StatusServiceUnavailable, "endpoint picker: no or conflicting destination")
		return fmt.Errorf("destination header %q vs metadata %q", inHeader, inMetadata)
	}
	var upstreamBody []byte
	if len(body) > 0 {
		for {
			chunk, err := s.next()
			if err != nil {
				refuse(w, http.StatusServiceUnavailable, "endpoint picker: "+err.Error())
				return err
			}
			streamed := chunk.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if streamed == nil {
				refuse(w, http.StatusServiceUnavailable, "endpoint picker: expected body chunks")
				return fmt.Errorf("expected a streamed request body, got %v", chunk)
			}
			upstreamBody = append(upstreamBody, streamed.GetBody()...)
			if streamed.GetEndOfStream() {
				break
			}
		}
	}
	upstreamHeaders.Del(destinationKey)
	response, served, err := g.send(r, path, upstreamHeaders, upstreamBody, strings.Split(inHeader, ","))
	if err != nil {
		refuse(w, http.StatusServiceUnavailable, "no endpoint could be reached: "+err.Error())
		return err
	}
	defer response.Body.Close()
	return g.respond(w, s, response, served)
}

// metadata is the dynamic metadata Envoy forwards with each message of a stream: the subset
// hint when the gateway has one and, once the response comes, the endpoint that served it.
func (g *gateway) metadata(served string) (*corev3.Metadata, error) {
	namespaces := map[string]*structpb.Struct{}
	if g.subset != nil {
		hint, err := structpb.NewStruct(map[string]any{subsetKey: toAny(g.subset)})
		if err != nil {
			return nil, err
		}
		namespaces[subsetNamespace] = hint
	}
	if served != "" {
		lb, err := structpb.NewStruct(map[string]any{servedKey: served})
		if err != nil {
			return nil, err
		}
		namespaces[destinationNamespace] = lb
	}
	if len(namespaces) == 0 {
		return nil, nil
	}
	return &corev3.Metadata{FilterMetadata: namespaces}, nil
}

// mutable says whether a picker may set or remove a request header, by the rules Envoy's
// ext_proc filter applies when its mutation_rules are unset: not host, :authority, :scheme or
// :method (ignored, not an error), nor x-envoy-*; :path may change (handled by the caller).
// GIE's EPP echoes every request header it saw, pseudo-headers included, in its answer.
func mutable(key string) bool {
	return !strings.HasPrefix(key, ":") && key != "host" && !strings.HasPrefix(key, "x-envoy-")
}

func toAny(items []string) []any {
	out := make([]any, len(items))
	for i, item := range items {
		out[i] = item
	}
	return out
}

// send posts to the endpoints in order until one accepts the connection.
func (g *gateway) send(
	r *http.Request, path string, headers http.Header, body []byte, endpoints []string,
) (*http.Response, string, error) {
	var last error
	for _, endpoint := range endpoints {
		endpoint = strings.TrimSpace(endpoint)
		request, err := http.NewRequestWithContext(
			r.Context(), r.Method, "http://"+endpoint+path, strings.NewReader(string(body)),
		)
		if err != nil {
			return nil, "", err
		}
		request.Header = headers.Clone()
		request.ContentLength = int64(len(body))
		response, err := g.upstream.Do(request)
		if err == nil {
			return response, endpoint, nil
		}
		last = err
	}
	return nil, "", last
}

func (g *gateway) respond(
	w http.ResponseWriter, s *stream, response *http.Response, served string,
) error {
	pairs := flatten(response.Header)
	pairs[":status"] = fmt.Sprint(response.StatusCode)
	metadata, err := g.metadata(served)
	if err != nil {
		return err
	}
	err = s.client.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(pairs),
		}},
		MetadataContext: metadata,
	})
	if err != nil {
		return err
	}
	answer, err := s.next()
	if err != nil {
		return err
	}
	for key, values := range response.Header {
		for _, value := range values {
			w.Header().Add(key, value)
		}
	}
	for _, option := range answer.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		w.Header().Set(option.GetHeader().GetKey(), headerValue(option.GetHeader()))
	}
	w.Header().Del("content-length") // the picker may change the body's length
	w.WriteHeader(response.StatusCode)
	// Full duplex, as Envoy streams in FULL_DUPLEX_STREAMED mode: the body goes to the picker
	// chunk by chunk without waiting for answers, and the picker's answers go to the client as
	// they come, until one says end_of_stream. A picker may answer each chunk (fleetpilot's,
	// and GIE's for an event stream) or hold a whole JSON body until its last chunk (GIE's).
	relayed := make(chan error, 1)
	go func() { relayed <- relayChunks(w, s) }()
	buffer := make([]byte, chunkBytes)
	var sendErr error
	for sendErr == nil {
		n, readErr := response.Body.Read(buffer)
		end := readErr != nil
		if n > 0 || end {
			sendErr = s.client.Send(&extprocv3.ProcessingRequest{
				Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
					Body: append([]byte(nil), buffer[:n]...), EndOfStream: end,
				}},
				MetadataContext: metadata,
			})
		}
		if end {
			if !errors.Is(readErr, io.EOF) && sendErr == nil {
				sendErr = readErr
			}
			break
		}
	}
	// The relay ends at the picker's end_of_stream, or at its error (a send that failed
	// broke the stream, so its answers end too).
	if err := <-relayed; err != nil {
		return err
	}
	return sendErr
}

// relayChunks writes the picker's streamed response body chunks to the client, flushing
// each, up to the one with end_of_stream.
func relayChunks(w http.ResponseWriter, s *stream) error {
	flusher, _ := w.(http.Flusher)
	for {
		answer, err := s.next()
		if err != nil {
			return err
		}
		streamed := answer.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if streamed == nil {
			return fmt.Errorf("expected a streamed response body, got %v", answer)
		}
		if _, err := w.Write(streamed.GetBody()); err != nil {
			return err
		}
		if flusher != nil {
			flusher.Flush()
		}
		if streamed.GetEndOfStream() {
			return nil
		}
	}
}
